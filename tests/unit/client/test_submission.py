"""One submission of the client library: the replies that arrived together come out together,
in order; an error comes after the replies before it; what may have lost a reply resubmits.

The publishes go to ``Published``, a test double that records them (no NATS here: the real
round trips are tests/integration/test_client.py and the fault suites)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import msgspec
import pytest
from nats.aio.msg import Msg

from service.client.calls import ClientError
from service.client.envelope import envelope
from service.client.exchanges import (
    EXPIRED,
    NO_RESPONDERS,
    RECONNECTED,
    CoordinatorWatch,
    Exchanges,
)
from service.client.submission import Submission
from service.protocol.arbiter import ArbiterTable
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode
from service.protocol.membership import CoordinatorHeartbeat
from service.protocol.messages import ErrorBody, ErrorReply, Final, Held, Partial, SubmitEnvelope
from service.protocol.subjects import Subjects

ENVELOPE = encode_msgpack(SubmitEnvelope(1, b"\x80", True, "r1", "c1", None, 10.0, None, None))


class Published:
    """Test double for the submission publish: records (body, reply subject, subject published
    to (None for the one all replicas share), headers)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.subjects: list[str] = []
        self.to: list[str | None] = []
        self.headers: list[Mapping[str, str] | None] = []

    async def __call__(
        self, body: bytes, reply_subject: str, subject: str | None, headers: Mapping[str, str] | None
    ) -> None:
        self.bodies.append(body)
        self.subjects.append(reply_subject)
        self.to.append(subject)
        self.headers.append(headers)


def partial(offset: int) -> bytes:
    return encode_msgpack(Partial("coord1-7", "r1", [offset], "x", offset=offset))


def final(tokens: int) -> bytes:
    return encode_msgpack(Final("coord1-7", "r1", "e1", list(range(tokens)), "x" * tokens, "length"))


async def started(
    published: Published, timeout: float = 10.0, watch: CoordinatorWatch | None = None
) -> tuple[Submission, Exchanges]:
    exchanges = Exchanges()
    exchanges.inbox = "_INBOX.me"
    watch = watch or CoordinatorWatch(exchanges, 1.0, 3.0)
    submission = Submission(
        published, exchanges, watch, ENVELOPE, timeout, address=lambda: watch.arbiter_subject("c1", "r1")
    )
    await submission.start()
    return submission, exchanges


def heartbeat(coordinator_id: str, arbitrates: bool = True, leaving: bool = False) -> Msg:
    """A replica's heartbeat as the watch's subscription receives it (a real nats-py Msg)."""
    body = encode_msgpack(CoordinatorHeartbeat(coordinator_id, leaving=leaving, arbitrates=arbitrates))
    return Msg(None, subject="p.coordinator_heartbeat", data=body)  # type: ignore[arg-type]  # no client needed


def deliver(exchanges: Exchanges, subject: str, *bodies: bytes) -> None:
    for body in bodies:
        exchanges.on_inline(subject.encode(), body, None)


async def test_the_replies_that_arrived_together_come_out_together_and_end_with_the_final() -> None:
    published = Published()
    submission, exchanges = await started(published)
    subject = published.subjects[0]
    deliver(exchanges, subject, partial(0), partial(1))
    assert [reply.offset for reply in await submission.replies()] == [0, 1]  # type: ignore[union-attr]
    deliver(exchanges, subject, partial(2), final(3), partial(9))  # nothing after the final counts
    last = await submission.replies()
    assert isinstance(last[0], Partial) and isinstance(last[1], Final) and len(last) == 2
    assert await submission.replies() == []
    submission.close()
    assert not exchanges.queues


async def test_an_error_reply_is_raised_after_the_replies_before_it() -> None:
    published = Published()
    submission, exchanges = await started(published)
    refusal = encode_msgpack(ErrorReply(ErrorBody(ErrorCode.NO_ENGINE, "none serves it"), "r1"))
    deliver(exchanges, published.subjects[0], partial(0), refusal)
    assert len(await submission.replies()) == 1
    with pytest.raises(ClientError) as raised:
        await submission.replies()
    assert raised.value.code == ErrorCode.NO_ENGINE
    submission.close()


async def test_the_deadline_is_a_timeout() -> None:
    submission, exchanges = await started(Published(), timeout=-1.99)  # the mailbox expires at once
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(submission.replies(), 5.0)
    submission.close()


async def test_no_responders_republishes_as_it_was_and_a_reconnect_as_a_resubmission() -> None:
    published = Published()
    submission, exchanges = await started(published)
    subject = published.subjects[0]
    mailbox = exchanges.queues[subject.rpartition(".")[2].encode()]
    mailbox.put_nowait(NO_RESPONDERS)
    mailbox.put_nowait(RECONNECTED)
    deliver(exchanges, subject, final(1))
    assert isinstance((await submission.replies())[0], Final)
    assert published.subjects == [subject] * 3
    first, again, marked = (msgspec.msgpack.decode(body, type=SubmitEnvelope) for body in published.bodies)
    assert not first.resubmission and not again.resubmission and marked.resubmission
    submission.close()


async def test_a_lost_replica_resubmits_only_the_requests_it_held() -> None:
    published = Published()
    submission, exchanges = await started(published)
    deliver(exchanges, published.subjects[0], partial(0))
    await submission.replies()  # the request is held by coord1 (its id names it) from now on
    exchanges.coordinator_lost("coord2")
    exchanges.coordinator_lost("coord1")
    mailbox = exchanges.queues[published.subjects[0].rpartition(".")[2].encode()]
    mailbox.put_nowait(EXPIRED)
    with pytest.raises(TimeoutError):
        await submission.replies()
    assert len(published.bodies) == 2  # the first publish, and one for coord1's loss
    submission.close()


async def test_a_submission_goes_to_its_arbiter_and_to_every_replica_when_that_one_is_gone() -> None:
    """The watch names the arbiter among the replicas that say they arbitrate; no-responders
    from it (it died) sends the copy, as it was, to the subject all replicas share."""
    published = Published()
    exchanges = Exchanges()
    watch = CoordinatorWatch(exchanges, 1.0, 3.0, Subjects("p"))
    assert watch.arbiter_subject("c1", "r1") is None  # no replica heard yet
    for replica in ("coord1", "coord2", "coord3"):
        await watch.on_heartbeat(heartbeat(replica))
    await watch.on_heartbeat(heartbeat("old", arbitrates=False))  # an earlier release takes no part
    arbiter = ArbiterTable({"coord1", "coord2", "coord3"}).of("c1", "r1")
    submission, exchanges = await started(published, watch=watch)
    assert published.to == [f"p.submit_request.{arbiter}"]
    mailbox = exchanges.queues[published.subjects[0].rpartition(".")[2].encode()]
    mailbox.put_nowait(NO_RESPONDERS)
    mailbox.put_nowait(RECONNECTED)  # from now on, to the shared subject (the arbiter may be gone)
    deliver(exchanges, published.subjects[0], final(1))
    await submission.replies()
    assert published.to[1:] == [None, None]
    assert not msgspec.msgpack.decode(published.bodies[1], type=SubmitEnvelope).resubmission
    submission.close()


async def test_a_leaving_replica_is_no_arbiter_and_a_refused_subject_stops_the_addressing() -> None:
    published = Published()
    exchanges = Exchanges()
    watch = CoordinatorWatch(exchanges, 1.0, 3.0, Subjects("p"))
    await watch.on_heartbeat(heartbeat("coord1"))
    await watch.on_heartbeat(heartbeat("coord2"))
    await watch.on_heartbeat(heartbeat("coord2", leaving=True))
    assert watch.arbiter_subject("c1", "r1") == "p.submit_request.coord1"  # the one left
    submission, exchanges = await started(published, watch=watch)
    watch.addressing = False  # what the client does when NATS refuses a replica's own subject
    exchanges.address_refused()
    mailbox = exchanges.queues[published.subjects[0].rpartition(".")[2].encode()]
    mailbox.put_nowait(EXPIRED)
    with pytest.raises(TimeoutError):
        await submission.replies()
    assert published.to == ["p.submit_request.coord1", None]
    assert watch.arbiter_subject("c1", "r2") is None
    submission.close()


async def test_a_held_notice_goes_to_on_held_and_every_publish_carries_the_headers() -> None:
    published = Published()
    exchanges = Exchanges()
    exchanges.inbox = "_INBOX.me"
    heard: list[Held] = []
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    watch = CoordinatorWatch(exchanges, 1.0, 3.0)
    submission = Submission(published, exchanges, watch, ENVELOPE, 10.0, headers=headers, on_held=heard.append)
    await submission.start()
    subject = published.subjects[0]
    exchanges.queues[subject.rpartition(".")[2].encode()].put_nowait(RECONNECTED)
    deliver(exchanges, subject, encode_msgpack(Held("coord1-7", "r1", "paused")), final(1))
    assert [type(reply) for reply in await submission.replies()] == [Final]
    assert heard == [Held("coord1-7", "r1", "paused")]
    assert published.headers == [headers, headers]  # the first publish and the resubmission
    submission.close()


def test_a_first_publish_is_no_resubmission_and_reads_reply_batches() -> None:
    body, request_id = envelope("me", "hi", None, None, False, None, 5.0, {"max_tokens": 2}, held_notices=True)
    sent = msgspec.msgpack.decode(body, type=SubmitEnvelope)
    assert (sent.resubmission, sent.batched_replies, sent.held_notices) == (False, True, True)
    assert sent.client_request_id == request_id and sent.client_id == "me" and sent.timeout_s == 5.0
