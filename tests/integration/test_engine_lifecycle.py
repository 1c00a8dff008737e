"""Engines joining, leaving, dying and restarting; replies from engines nobody knows."""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client as NATS

from service.coordinator.coordinator import Coordinator
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect, EngineRegister, Heartbeat
from service.protocol.routed import EngineReplyBatch, ReturnPath, RoutedReply
from tests.conftest import EngineFactory
from tests.helpers import decode_reply, engines_become, request_json


def subject(coordinator: Coordinator, header: str) -> str:
    return coordinator.subjects.coordinator(header)


async def test_unstreamed_request_of_a_departed_engine_is_retried_elsewhere(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """An engine registered by hand, alone in the pool, takes the request and leaves without answering."""
    await nc.request(
        coordinator.subjects.sent_by("register", "doomed"),
        encode_msgpack(EngineRegister("doomed", capacity=1000)),
        timeout=5,
    )
    doomed_inbox = await nc.subscribe(coordinator.subjects.engine("doomed", "submit_request"))
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject(coordinator, "submit_request"), b'{"prompt": "retry me"}', reply=inbox)
    await doomed_inbox.next_msg(timeout=5)
    [real] = await start_engines(1)
    await nc.publish(
        coordinator.subjects.sent_by("disconnect", "doomed"), encode_msgpack(EngineDisconnect("doomed", "test"))
    )
    final = decode_reply((await sub.next_msg(timeout=5)).data)
    assert final["type"] == "final" and final["engine_id"] == real.engine_id
    assert coordinator.counters["retried"] == 1


async def test_streamed_request_of_a_departed_engine_fails_with_503_without_migrations(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """With ``max_migrations`` 0 a stream cannot continue elsewhere (tests/integration/test_migration.py
    shows it does otherwise)."""
    coordinator.settings.max_migrations = 0
    [engine] = await start_engines(1, token_delay_ms=20)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"prompt": "s", "stream": True, "sampling_params": {"max_tokens": 10_000}}
    await nc.publish(subject(coordinator, "submit_request"), json.dumps(body).encode(), reply=inbox)
    assert decode_reply((await sub.next_msg(timeout=5)).data)["type"] == "partial"
    await nc.publish(
        coordinator.subjects.sent_by("disconnect", engine.engine_id),
        encode_msgpack(EngineDisconnect(engine.engine_id, "test")),
    )
    while (msg := await sub.next_msg(timeout=5)).data:
        last = decode_reply(msg.data)
    assert last["type"] == "error" and last["error"]["code"] == 503 and engine.engine_id in last["error"]["message"]
    assert "max_migrations (0)" in last["error"]["message"]


async def test_silent_engine_is_removed_after_heartbeat_timeout(coordinator: Coordinator, nc: NATS) -> None:
    await nc.request(
        coordinator.subjects.sent_by("register", "mute"), encode_msgpack(EngineRegister("mute")), timeout=5
    )
    assert coordinator.engines.get("mute") is not None
    loop = asyncio.get_running_loop()
    registered_at = loop.time()
    await engines_become(coordinator, 0)
    elapsed = loop.time() - registered_at
    assert coordinator.settings.heartbeat_timeout_s <= elapsed < 3 * coordinator.settings.heartbeat_timeout_s


async def test_heartbeat_from_unknown_engine_adopts_it(coordinator: Coordinator, nc: NATS) -> None:
    await nc.publish(
        coordinator.subjects.sent_by("heartbeat", "stranger"), encode_msgpack(Heartbeat("stranger", load=3, capacity=8))
    )
    await engines_become(coordinator, 1)
    record = coordinator.engines.get("stranger")
    assert record is not None and record.capacity == 8 and record.load == 0


async def test_engine_registering_again_starts_with_zero_load(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await nc.request(
        coordinator.subjects.sent_by("register", "phoenix"), encode_msgpack(EngineRegister("phoenix")), timeout=5
    )
    sink = await nc.subscribe(coordinator.subjects.engine("phoenix", "submit_request"))
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject(coordinator, "submit_request"), b'{"prompt": "lost"}', reply=inbox)
    await sink.next_msg(timeout=5)
    assert coordinator.engines.get("phoenix").load == 1  # type: ignore[union-attr]
    coordinator.settings.max_retries = 0
    await nc.request(
        coordinator.subjects.sent_by("register", "phoenix"), encode_msgpack(EngineRegister("phoenix")), timeout=5
    )
    assert coordinator.engines.get("phoenix").load == 0  # type: ignore[union-attr]
    error = decode_reply((await sub.next_msg(timeout=5)).data)
    assert error["error"]["code"] == 503


async def test_replies_for_unknown_requests_and_engines_are_dropped(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    stray_inbox = nc.new_inbox()
    stray = await nc.subscribe(stray_inbox)
    return_path = ReturnPath("nobody-1", coordinator.id, stray_inbox, "json", False, None)
    batch = EngineReplyBatch("ghost-engine", [RoutedReply(return_path, b'{"type":"final"}')])
    await nc.publish(coordinator.subjects.sent_by("engine_reply", "ghost-engine"), encode_msgpack(batch))
    await nc.publish(coordinator.subjects.sent_by("engine_reply_partial", "ghost-engine"), encode_msgpack(batch))
    assert (await request_json(nc, subject(coordinator, "submit_request"), {"prompt": "still fine"}))["type"] == "final"
    await nc.flush()
    assert stray.pending_msgs == 0
    assert coordinator.counters["late_replies"] == 1
