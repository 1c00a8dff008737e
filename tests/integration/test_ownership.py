"""One owner per request across coordinator replicas (docs/reliability.md, ownership).

Two in-process replicas share one subject prefix and queue group on the session's
nats-server, with echo engines (the documented test double of engines/echo.py). Messages
through the queue group reach either replica at random, so each test sends enough of them
that some surely reach the replica that does not hold the request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.messages import AbortRequest, SamplingParams, SubmitEnvelope, SubmitRequest
from service.protocol.subjects import Header, Subjects
from tests.helpers import decode_reply, until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def pair(settings: Settings) -> AsyncIterator[tuple[Coordinator, Coordinator]]:
    first = Coordinator(settings.model_copy(update={"coordinator_id": "c1"}), HANDLERS)
    second = Coordinator(settings.model_copy(update={"coordinator_id": "c2"}), HANDLERS)
    async with first, second:
        await until(lambda: first.peers.live() == ["c2"] and second.peers.live() == ["c1"], 10)
        yield first, second


@pytest.fixture
async def engine(settings: Settings, pair: tuple[Coordinator, Coordinator]) -> AsyncIterator[EngineRuntime]:
    runtime = EngineRuntime(settings, EchoBackend(token_delay_ms=10.0))
    await runtime.start()
    await asyncio.wait_for(runtime.registered.wait(), 10)

    await until(lambda: all(len(coordinator.engines) == 1 for coordinator in pair), 10)
    yield runtime
    await runtime.stop()


def envelope(client_request_id: str, prompt: str, max_tokens: int, resubmission: bool) -> bytes:
    params = SamplingParams(max_tokens=max_tokens, timeout_s=30.0)
    body = encode_msgpack(SubmitRequest(prompt, params, True, client_request_id, "k"))
    return encode_msgpack(SubmitEnvelope(1, body, True, client_request_id, "k", None, 30.0, resubmission=resubmission))


async def test_resubmissions_reaching_the_other_replica_never_run_twice(
    settings: Settings, pair: tuple[Coordinator, Coordinator], engine: EngineRuntime, nc: NATS
) -> None:
    """A resubmission the receiving replica does not hold is handed to the replica arbitrating
    its id, which holds it, so the stream is one run's, exactly, however many resubmissions the
    queue group spreads."""
    subjects = Subjects(settings.subject_prefix)
    inbox = f"_INBOX.{uuid.uuid4().hex}"
    replies = await nc.subscribe(inbox)
    prompt, max_tokens = "abcdefghij", 40
    await nc.publish(subjects.coordinator(Header.SUBMIT_REQUEST), envelope("r1", prompt, max_tokens, False), inbox)
    first = decode_reply((await replies.next_msg(timeout=5)).data)
    for _ in range(12):
        again = envelope("r1", prompt, max_tokens, True)
        await nc.publish(subjects.coordinator(Header.SUBMIT_REQUEST), again, inbox)
    tokens = list(first["new_tokens"])
    while True:
        msg = await replies.next_msg(timeout=10)
        if not msg.data:
            break
        reply = decode_reply(msg.data)
        assert reply["type"] in ("partial", "final"), reply
        if reply["type"] == "partial":
            tokens.extend(reply["new_tokens"])
        else:
            final = reply
    expected = [ord(prompt[n % len(prompt)]) for n in range(max_tokens)]
    assert final["generated_tokens"] == expected and tokens == expected
    assert sum(coordinator.counters["submitted"] for coordinator in pair) == 1
    assert sum(coordinator.counters["submissions_handed"] for coordinator in pair) >= 1


async def test_aborts_reaching_the_other_replica_free_every_slot(
    settings: Settings, pair: tuple[Coordinator, Coordinator], engine: EngineRuntime, nc: NATS
) -> None:
    """Each abort goes through the queue group once; the one that reaches the replica not
    holding its request is forwarded to the owner, so every abort is acknowledged and the
    engine ends with no request held."""
    subjects = Subjects(settings.subject_prefix)
    inbox = f"_INBOX.{uuid.uuid4().hex}"
    replies = await nc.subscribe(f"{inbox}.*")
    count = 12
    for n in range(count):
        body = envelope(f"a{n}", "abc", 100_000, False)
        await nc.publish(subjects.coordinator(Header.SUBMIT_REQUEST), body, f"{inbox}.{n}")
    for _ in range(count):  # the first partial of each: every request is running
        await replies.next_msg(timeout=5)
    acks = []
    for n in range(count):
        abort = msgspec.msgpack.encode(AbortRequest(f"a{n}", "k"))
        msg = await nc.request(subjects.coordinator(Header.ABORT_REQUEST), abort, timeout=5)
        acks.append(decode_reply(msg.data))
    assert all(ack["type"] == "ack" for ack in acks), acks
    assert sum(coordinator.counters["aborts_forwarded"] for coordinator in pair) >= 1

    await until(lambda: engine.load == 0 and all(len(coordinator.requests) == 0 for coordinator in pair))


async def test_a_plain_publish_may_reply_only_under_the_shared_inbox(
    settings: Settings, pair: tuple[Coordinator, Coordinator], engine: EngineRuntime, nc: NATS
) -> None:
    """A submission without a NATS reply subject names no sender: a ``reply_to`` under a
    per-user inbox (another role's, say) is refused, and nothing is sent there."""
    subjects = Subjects(settings.subject_prefix)
    foreign = await nc.subscribe("_INBOX_admin.>")
    shared = await nc.subscribe("_INBOX.me.>")
    submit = subjects.coordinator(Header.SUBMIT_REQUEST)
    await nc.publish(submit, b'{"prompt": "Hi", "reply_to": "_INBOX_admin.acks"}')
    await nc.publish(submit, b'{"prompt": "Hi", "reply_to": "_INBOX.me.1"}')
    final = decode_reply((await shared.next_msg(timeout=5)).data)
    assert final["type"] == "final"

    await until(lambda: sum(coordinator.counters["error_400"] for coordinator in pair) == 1)
    for coordinator in pair:  # whatever a replica published has reached the server, then us
        await coordinator.nc.flush()
    await nc.flush()
    assert foreign.pending_msgs == 0


async def test_a_replica_that_stops_leaves_its_running_requests_to_a_peer(
    settings: Settings, pair: tuple[Coordinator, Coordinator], engine: EngineRuntime, nc: NATS
) -> None:
    """A rolling restart: the replica that stops says so in its last heartbeat, and the other
    adopts the requests its engines hold, which end with every token instead of an error."""
    subjects = Subjects(settings.subject_prefix)
    inbox = f"_INBOX.{uuid.uuid4().hex}"
    replies = await nc.subscribe(f"{inbox}.*")
    prompt, max_tokens, count = "abcdefghij", 300, 8
    for n in range(count):
        body = envelope(f"s{n}", prompt, max_tokens, False)
        await nc.publish(subjects.coordinator(Header.SUBMIT_REQUEST), body, f"{inbox}.{n}")
    first, second = pair
    await until(lambda: len(first.requests) + len(second.requests) == count)
    leaving, staying = (first, second) if len(first.requests) >= len(second.requests) else (second, first)
    held = len(leaving.requests)
    await leaving.stop()
    finals: dict[str, dict[str, object]] = {}
    while len(finals) < count:
        msg = await replies.next_msg(timeout=10)
        if msg.data:
            reply = decode_reply(msg.data)
            assert reply["type"] in ("partial", "final"), reply
            if reply["type"] == "final":
                finals[msg.subject] = reply
    expected = [ord(prompt[n % len(prompt)]) for n in range(max_tokens)]
    assert all(final["generated_tokens"] == expected for final in finals.values())
    assert staying.counters["requests_adopted"] == held
    assert leaving.counters["failed_503"] == 0
