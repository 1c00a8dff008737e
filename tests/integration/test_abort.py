from __future__ import annotations

import json

from nats.aio.client import Client as NATS

from service.coordinator.coordinator import Coordinator
from tests.conftest import EngineFactory
from tests.helpers import decode_reply, request_json


def subject(coordinator: Coordinator, header: str) -> str:
    return coordinator.subjects.coordinator(header)


async def start_stream(nc: NATS, coordinator: Coordinator, body: dict) -> tuple[object, dict]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject(coordinator, "submit_request"), json.dumps({**body, "stream": True}).encode(), reply=inbox)
    first = decode_reply((await sub.next_msg(timeout=5)).data)
    return sub, first


async def rest_of_stream(sub: object) -> list[dict]:
    replies = []
    while (msg := await sub.next_msg(timeout=5)).data:  # type: ignore[attr-defined]
        replies.append(decode_reply(msg.data))
    return replies


async def test_abort_by_client_request_id(coordinator: Coordinator, start_engines: EngineFactory, nc: NATS) -> None:
    [engine] = await start_engines(1, token_delay_ms=20)
    body = {"prompt": "abc", "client_id": "alice", "client_request_id": "q1", "sampling_params": {"max_tokens": 10_000}}
    sub, first = await start_stream(nc, coordinator, body)
    assert first["type"] == "partial"
    ack = await request_json(
        nc, subject(coordinator, "abort_request"), {"client_id": "alice", "client_request_id": "q1"}
    )
    assert ack == {"type": "ack", "signal": "abort_request", "request_id": first["request_id"]}
    final = (await rest_of_stream(sub))[-1]
    assert final["type"] == "final" and final["finish_reason"] == "abort" and final["client_request_id"] == "q1"
    assert 1 <= len(final["generated_tokens"]) < 10_000
    assert engine.load == 0 and len(coordinator.requests) == 0


async def test_abort_by_request_id(coordinator: Coordinator, start_engines: EngineFactory, nc: NATS) -> None:
    await start_engines(1, token_delay_ms=20)
    sub, first = await start_stream(nc, coordinator, {"prompt": "x", "sampling_params": {"max_tokens": 10_000}})
    ack = await request_json(nc, subject(coordinator, "abort_request"), {"request_id": first["request_id"]})
    assert ack["request_id"] == first["request_id"]
    assert (await rest_of_stream(sub))[-1]["finish_reason"] == "abort"


async def test_client_ids_are_namespaces(coordinator: Coordinator, start_engines: EngineFactory, nc: NATS) -> None:
    await start_engines(1, token_delay_ms=20)
    sub, _ = await start_stream(
        nc, coordinator, {"prompt": "x", "client_request_id": 1, "sampling_params": {"max_tokens": 10_000}}
    )
    wrong_client = await request_json(
        nc, subject(coordinator, "abort_request"), {"client_id": "bob", "client_request_id": 1}
    )
    assert wrong_client["error"]["code"] == 404
    anonymous = await request_json(nc, subject(coordinator, "abort_request"), {"client_request_id": 1})
    assert anonymous["type"] == "ack"
    assert (await rest_of_stream(sub))[-1]["finish_reason"] == "abort"


async def test_abort_of_held_request(coordinator: Coordinator, start_engines: EngineFactory, nc: NATS) -> None:
    await start_engines(1)
    await request_json(nc, subject(coordinator, "pause"), {})
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(
        subject(coordinator, "submit_request"), b'{"prompt": "held", "client_request_id": "h"}', reply=inbox
    )
    ack = await request_json(nc, subject(coordinator, "abort_request"), {"client_request_id": "h"})
    assert ack["type"] == "ack"
    final = decode_reply((await sub.next_msg(timeout=5)).data)
    assert final["finish_reason"] == "abort" and final["engine_id"] is None and final["generated_tokens"] == []
    await request_json(nc, subject(coordinator, "unpause"), {})
    await request_json(nc, subject(coordinator, "submit_request"), {"prompt": "after"})
    assert sub.pending_msgs == 0


async def test_abort_unknown_is_404_and_empty_abort_is_400(coordinator: Coordinator, nc: NATS) -> None:
    unknown = await request_json(nc, subject(coordinator, "abort_request"), {"request_id": "nope"})
    assert unknown["error"]["code"] == 404
    unknown_client = await request_json(nc, subject(coordinator, "abort_request"), {"client_request_id": 5})
    assert unknown_client["error"]["code"] == 404 and unknown_client["client_request_id"] == 5
    empty = await request_json(nc, subject(coordinator, "abort_request"), {})
    assert empty["error"]["code"] == 400
