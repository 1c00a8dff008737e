"""A stream's flow control in the client library (service/client/flow.py): its mailbox counts
the replies not read, a reader that falls behind holds the request and releases it once it
caught up, and a stream held for the stall limit is aborted and fails its next read.

No NATS here: the holds and aborts go to ``FlowRecorder``, a test double that records them;
the real round trips are tests/integration/test_slow_readers.py."""

from __future__ import annotations

import asyncio

import pytest

from service.client import flow
from service.client.exchanges import RECONNECTED, CoordinatorWatch, Exchanges
from service.client.flow import FlowControl, FlowLimits, StreamStalled
from service.client.mailbox import ITEM_BYTES, NEVER, TAKE_BYTES, Mailbox
from service.client.submission import Submission
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode
from service.protocol.messages import Final, Partial, SubmitEnvelope
from tests.unit.client.test_submission import Published

ENVELOPE = encode_msgpack(SubmitEnvelope(1, b"\x80", True, "r1", "c1", None, 10.0, None, None))
REQUEST_ID = "coord1-7"


class FlowRecorder:
    """Test double for the client's hold and abort: records what it was asked."""

    def __init__(self) -> None:
        self.holds: list[tuple[str, bool, int]] = []
        self.aborts: list[str] = []
        self.aborted = asyncio.Event()

    async def send(self, request_id: str, held: bool, seq: int) -> None:
        self.holds.append((request_id, held, seq))

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self.aborted.set()


def partial(offset: int) -> bytes:
    return encode_msgpack(Partial(REQUEST_ID, "r1", [offset], "x", offset=offset))


PARTIAL_BYTES = len(partial(0)) + ITEM_BYTES


async def flowing(limit: int, stall_s: float = 60.0) -> tuple[Submission, Exchanges, str, FlowRecorder]:
    recorder = FlowRecorder()
    published = Published()
    exchanges = Exchanges()
    exchanges.inbox = "_INBOX.me"
    flow = FlowControl(FlowLimits(limit, stall_s), recorder)
    submission = Submission(published, exchanges, CoordinatorWatch(exchanges, 1.0, 3.0), ENVELOPE, 10.0, flow)
    await submission.start()
    return submission, exchanges, published.subjects[0], recorder


def deliver(exchanges: Exchanges, subject: str, *bodies: bytes) -> None:
    for body in bodies:
        exchanges.on_inline(subject.encode(), body, None)


async def settle() -> None:
    """Let the tasks that publish holds run."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_mailbox_counts_what_waits_and_hands_a_backlog_over_in_bounded_pieces() -> None:
    mailbox = Mailbox(asyncio.get_running_loop())
    body = b"x" * 1000
    count = 3 * TAKE_BYTES // (len(body) + ITEM_BYTES)
    for _ in range(count):
        mailbox.put_reply(body)
    mailbox.put_nowait("marker")  # markers count nothing
    assert mailbox.unread == count * (len(body) + ITEM_BYTES)
    pieces = []
    while mailbox.unread:
        pieces.append(await mailbox.take())
    assert len(pieces) == 3
    for piece in pieces[:-1]:
        assert TAKE_BYTES <= len(piece) * (len(body) + ITEM_BYTES) < TAKE_BYTES + len(body) + ITEM_BYTES
    assert [item for piece in pieces for item in piece] == [body] * count + ["marker"]
    assert mailbox.alarm == NEVER  # without a watcher nothing is watched


async def test_a_reader_that_falls_behind_holds_the_request_again_as_more_arrives_and_releases_it_at_half() -> None:
    limit = 20 * PARTIAL_BYTES
    submission, exchanges, subject, recorder = await flowing(limit)
    deliver(exchanges, subject, partial(0))
    assert len(await submission.replies()) == 1  # the reader learns the request id
    deliver(exchanges, subject, *(partial(n) for n in range(1, 21)))
    await settle()
    assert recorder.holds == []  # at the bound, not past it
    deliver(exchanges, subject, partial(21))
    await settle()
    assert recorder.holds == [(REQUEST_ID, True, 1)]  # past the bound: held, once
    deliver(exchanges, subject, *(partial(n) for n in range(22, 28)))
    await settle()
    assert recorder.holds[1:] == [(REQUEST_ID, True, 2)]  # a quarter more: held again
    taken = await submission.replies()
    await settle()
    assert [reply.offset for reply in taken] == list(range(1, 28))  # type: ignore[union-attr]
    assert recorder.holds[2:] == [(REQUEST_ID, False, 3)]  # drained: released
    deliver(exchanges, subject, *(partial(n) for n in range(28, 40)))
    await settle()
    assert len(recorder.holds) == 3  # below the bound again: nothing sent
    submission.close()


async def test_a_stream_held_for_the_stall_limit_is_aborted_and_its_next_read_raises_408() -> None:
    submission, exchanges, subject, recorder = await flowing(4 * PARTIAL_BYTES, stall_s=0.05)
    deliver(exchanges, subject, partial(0))
    await submission.replies()
    deliver(exchanges, subject, *(partial(n) for n in range(1, 7)))
    await asyncio.wait_for(recorder.aborted.wait(), 5.0)
    assert recorder.aborts == [REQUEST_ID]
    assert not exchanges.queues  # nothing more is delivered to it
    with pytest.raises(StreamStalled) as raised:
        await submission.replies()  # what waited was dropped: the error comes at once
    assert raised.value.code == ErrorCode.STALLED
    assert "took nothing for 0.05 s" in raised.value.message
    submission.close()
    assert [held for _, held, _ in recorder.holds] == [True]  # no release after a stall


async def test_a_stream_whose_end_arrived_is_not_aborted_at_the_stall_limit() -> None:
    submission, exchanges, subject, recorder = await flowing(4 * PARTIAL_BYTES, stall_s=0.05)
    deliver(exchanges, subject, partial(0))
    await submission.replies()
    final = encode_msgpack(Final(REQUEST_ID, "r1", "e1", list(range(8)), "x" * 8, "length"))
    deliver(exchanges, subject, *(partial(n) for n in range(1, 7)), final, b"")
    await asyncio.sleep(0.2)
    assert recorder.aborts == []
    replies = await submission.replies()
    assert isinstance(replies[-1], Final) and len(replies) == 7
    submission.close()


async def test_an_engine_that_does_not_hold_is_cut_off_at_twice_the_bound_but_a_final_is_kept() -> None:
    limit = 4 * PARTIAL_BYTES
    submission, exchanges, subject, recorder = await flowing(limit)
    deliver(exchanges, subject, partial(0))
    await submission.replies()
    final = encode_msgpack(Final(REQUEST_ID, "r1", "e1", list(range(200)), "x" * 200, "length"))
    deliver(exchanges, subject, *(partial(n) for n in range(1, 8)), final)  # the final passes twice the bound
    await settle()
    assert recorder.aborts == []
    assert isinstance((await submission.replies())[-1], Final)
    submission.close()

    submission, exchanges, subject, recorder = await flowing(limit)
    deliver(exchanges, subject, partial(0))
    await submission.replies()
    deliver(exchanges, subject, *(partial(n) for n in range(1, 10)))  # partials past twice the bound
    await asyncio.wait_for(recorder.aborted.wait(), 5.0)
    with pytest.raises(StreamStalled, match="did not hold it"):
        await submission.replies()
    submission.close()


async def test_closing_a_held_stream_releases_its_request() -> None:
    submission, exchanges, subject, recorder = await flowing(4 * PARTIAL_BYTES)
    deliver(exchanges, subject, *(partial(n) for n in range(6)))  # before the reader read: the id from a reply
    await settle()
    assert recorder.holds == [(REQUEST_ID, True, 1)]
    submission.close()
    await settle()
    assert recorder.holds[1:] == [(REQUEST_ID, False, 2)]


async def test_a_release_is_sent_again_while_its_reader_starves_and_the_state_after_a_reconnect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(flow, "RELEASE_CHECKS_S", (0.01, 0.02, 0.04))
    submission, exchanges, subject, recorder = await flowing(4 * PARTIAL_BYTES)
    deliver(exchanges, subject, *(partial(n) for n in range(6)))
    assert len(await submission.replies()) == 6  # held on arrival, released as it read
    waiting = asyncio.ensure_future(submission.replies())  # the reader waits; nothing comes (a lost release?)
    await asyncio.sleep(0.3)
    assert [(held, seq) for _, held, seq in recorder.holds] == [
        (True, 1),
        (False, 2),
        (False, 3),
        (False, 4),
        (False, 5),
    ]
    [mailbox] = exchanges.queues.values()
    mailbox.put_nowait(RECONNECTED)
    deliver(exchanges, subject, partial(6))
    assert len(await asyncio.wait_for(waiting, 5.0)) == 1
    await settle()
    assert recorder.holds[-1] == (REQUEST_ID, False, 6)  # the state again after the reconnect
    submission.close()
