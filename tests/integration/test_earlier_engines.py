"""Engines of earlier releases send on the plain ``<prefix>.<header>`` subjects, naming themselves
in the body: the coordinator still serves them (the wire contract is extended, never renamed),
and no such message may speak for an engine that sends on its own subjects.

The old engine here is built by hand on raw nats-py, as docs/protocol.md described it.
"""

from __future__ import annotations

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from service.coordinator.coordinator import Coordinator
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect, EngineRegister, Heartbeat, RegisterAck
from service.protocol.messages import Final
from service.protocol.routed import EngineReplyBatch, RoutedReply, RoutedRequestBatch
from tests.conftest import EngineFactory
from tests.helpers import engines_become, request_json


def plain(coordinator: Coordinator, header: str) -> str:
    return f"{coordinator.subjects.prefix}.{header}"


async def test_an_engine_of_an_earlier_release_registers_serves_and_leaves(coordinator: Coordinator, nc: NATS) -> None:
    engine_id = "old-engine"

    async def serve(msg: Msg) -> None:
        """Answer each routed request with a final, on the plain engine_reply subject."""
        batch = msgspec.msgpack.decode(msg.data, type=RoutedRequestBatch)
        replies = []
        for routed in batch.requests:
            request_id = routed.return_path.request_id
            final = Final(request_id, routed.return_path.client_request_id, engine_id, [7], "old", "length")
            replies.append(RoutedReply(routed.return_path, msgspec.json.encode(final)))
        await nc.publish(plain(coordinator, "engine_reply"), encode_msgpack(EngineReplyBatch(engine_id, replies)))

    await nc.subscribe(coordinator.subjects.engine(engine_id, "submit_request"), cb=serve)
    answer = await nc.request(plain(coordinator, "register"), encode_msgpack(EngineRegister(engine_id)), timeout=5)
    assert msgspec.msgpack.decode(answer.data, type=RegisterAck).coordinator_id == coordinator.id
    await nc.publish(plain(coordinator, "heartbeat"), encode_msgpack(Heartbeat(engine_id)))
    record = coordinator.engines.get(engine_id)
    assert record is not None and not record.own_subjects

    final = await request_json(
        nc, coordinator.subjects.coordinator("submit_request"), {"prompt": "hi", "sampling_params": {"max_tokens": 1}}
    )
    assert final["type"] == "final" and final["generated_text"] == "old" and final["engine_id"] == engine_id

    await nc.publish(plain(coordinator, "disconnect"), encode_msgpack(EngineDisconnect(engine_id, "bye")))
    await engines_become(coordinator, 0)


async def test_the_plain_subject_cannot_speak_for_an_engine_on_its_own_subjects(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1)
    assert coordinator.engines.get(engine.engine_id).own_subjects  # type: ignore[union-attr]
    inbox = nc.new_inbox()
    answers = await nc.subscribe(inbox)
    for header, message in (
        ("disconnect", EngineDisconnect(engine.engine_id, "spoofed")),
        ("register", EngineRegister(engine.engine_id)),
    ):
        await nc.publish(plain(coordinator, header), encode_msgpack(message), reply=inbox)
        refusal = msgspec.msgpack.decode((await answers.next_msg(timeout=5)).data)
        assert refusal["error"]["code"] == 403 and "own subjects" in refusal["error"]["message"]
    final = await request_json(
        nc, coordinator.subjects.coordinator("submit_request"), {"prompt": "ok", "sampling_params": {"max_tokens": 2}}
    )
    assert final["type"] == "final" and final["engine_id"] == engine.engine_id
    assert coordinator.counters["error_403"] == 2
