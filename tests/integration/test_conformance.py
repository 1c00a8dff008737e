"""An engine written from docs/protocol.md alone (benchmarks/doc_engines.py: msgpack by hand,
no import from this project) against a real coordinator: it registers, heartbeats, serves
routed requests in both encodings and from the client library, streams partials, is aborted,
confirms control signals and disconnects. If the documentation is wrong, this fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import msgpack
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from benchmarks.doc_engines import DocEngineFleet
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.conftest import make_settings
from tests.helpers import decode_reply, engines_become, request_json, request_stream

ENGINE_IDS = ["doc-a", "doc-b"]


@pytest.fixture(params=["least_loaded", "prefix"])
def settings(nats_url: str, request: pytest.FixtureRequest) -> Settings:
    """Every test once per routing policy: prefix routing reads the envelope's extension."""
    return make_settings(nats_url, routing_policy=request.param)


@pytest.fixture
async def fleet(coordinator: Coordinator, nc: NATS) -> AsyncIterator[DocEngineFleet]:
    fleet = DocEngineFleet(
        nc,
        coordinator.subjects.prefix,
        ENGINE_IDS,
        capacity=8,
        heartbeat_interval_s=coordinator.settings.heartbeat_interval_s,
        token_delay_s=0.01,
    )
    await fleet.start()
    await fleet.register()
    yield fleet
    await fleet.leave()


def submit_subject(coordinator: Coordinator) -> str:
    return coordinator.subjects.coordinator("submit_request")


async def test_registration_is_acknowledged_and_heartbeats_keep_engines(
    coordinator: Coordinator, fleet: DocEngineFleet, nc: NATS
) -> None:
    assert fleet.coordinator_ids == {coordinator.id}
    await engines_become(coordinator, 2)
    beats: dict[str, int] = {}
    enough = asyncio.Event()
    wanted = 2 * round(coordinator.settings.heartbeat_timeout_s / coordinator.settings.heartbeat_interval_s)

    async def count(msg: Msg) -> None:
        engine_id = msgpack.unpackb(msg.data)["engine_id"]
        beats[engine_id] = beats.get(engine_id, 0) + 1
        if len(beats) == 2 and min(beats.values()) >= wanted:
            enough.set()

    sub = await nc.subscribe(coordinator.subjects.sent_by_any("heartbeat"), cb=count)
    await asyncio.wait_for(enough.wait(), 10)  # two heartbeat timeouts' worth of beats
    await sub.unsubscribe()
    assert sorted(record.engine_id for record in coordinator.engines) == ENGINE_IDS


async def test_routed_requests_are_served_in_both_encodings(
    coordinator: Coordinator, fleet: DocEngineFleet, nc: NATS
) -> None:
    reply = await request_json(nc, submit_subject(coordinator), {"prompt": "hey", "sampling_params": {"max_tokens": 5}})
    assert (reply["type"], reply["generated_text"], reply["finish_reason"]) == ("final", "heyhe", "length")
    assert reply["engine_id"] in ENGINE_IDS
    body = msgpack.packb({"prompt": [5, 6], "sampling_params": {"max_tokens": 3}, "client_request_id": 7})
    reply = decode_reply((await nc.request(submit_subject(coordinator), body, timeout=5)).data)
    assert (reply["generated_tokens"], reply["client_request_id"]) == ([5, 6, 5], 7)


async def test_the_client_librarys_envelope_reaches_the_engine(coordinator: Coordinator, fleet: DocEngineFleet) -> None:
    async with await DpcoordClient.connect(coordinator.settings) as client:
        final = await client.submit([1, 2, 3] * 20, max_tokens=4, timeout=10)  # long enough to carry prefix hashes
    assert final.generated_tokens == [1, 2, 3, 1] and final.engine_id in ENGINE_IDS


async def test_partials_stream_before_the_final(coordinator: Coordinator, fleet: DocEngineFleet, nc: NATS) -> None:
    body = json.dumps({"prompt": "abc", "stream": True, "sampling_params": {"max_tokens": 4}}).encode()
    messages = await request_stream(nc, submit_subject(coordinator), body)
    replies = [json.loads(msg.data) for msg in messages[:-1]]
    assert [reply["type"] for reply in replies] == ["partial"] * 4 + ["final"]
    assert "".join(reply["text"] for reply in replies[:-1]) == replies[-1]["generated_text"] == "abca"
    assert messages[-1].data == b""


async def test_abort_reaches_the_engine(coordinator: Coordinator, fleet: DocEngineFleet, nc: NATS) -> None:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"prompt": "x", "client_id": "conf", "client_request_id": "long", "sampling_params": {"max_tokens": 100_000}}
    await nc.publish(submit_subject(coordinator), json.dumps(body).encode(), reply=inbox)
    abort = {"client_id": "conf", "client_request_id": "long"}
    for _ in range(50):  # until the submission has been admitted
        ack = await request_json(nc, coordinator.subjects.coordinator("abort_request"), abort)
        if ack["type"] == "ack":
            break
    final = json.loads((await sub.next_msg(timeout=5)).data)
    assert (final["type"], final["finish_reason"]) == ("final", "abort")


async def test_control_signals_are_confirmed_by_every_engine(
    coordinator: Coordinator, fleet: DocEngineFleet, nc: NATS
) -> None:
    control = coordinator.subjects.coordinator
    assert (await request_json(nc, control("pause"), {}))["state"] == "paused"
    held = asyncio.ensure_future(
        request_json(nc, submit_subject(coordinator), {"prompt": "later", "sampling_params": {"max_tokens": 1}})
    )
    ack = await request_json(nc, control("set_generation_epoch"), {"epoch": 5})
    assert ack["epoch"] == 5
    assert not held.done()
    assert (await request_json(nc, control("unpause"), {}))["state"] == "running"
    assert (await held)["generated_text"] == "l"
    confirmed = {(engine_id, signal) for engine_id, signal, _ in fleet.signals}
    assert confirmed == {
        (engine_id, signal) for engine_id in ENGINE_IDS for signal in ("pause", "set_generation_epoch", "unpause")
    }
    # `{epoch?, revision?}`: the epoch as sent, and the control state's revision where replicas share one.
    assert all(payload["epoch"] == 5 for _, signal, payload in fleet.signals if signal == "set_generation_epoch")


async def test_stop_fails_in_flight_requests(coordinator: Coordinator, fleet: DocEngineFleet, nc: NATS) -> None:
    control = coordinator.subjects.coordinator
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(
        submit_subject(coordinator), b'{"prompt": "y", "sampling_params": {"max_tokens": 100000}}', reply=inbox
    )
    assert (await request_json(nc, control("pause"), {}))["type"] == "ack"
    ack = await request_json(nc, control("stop"), {})
    assert (ack["type"], ack["state"]) == ("ack", "stopping")
    error = json.loads((await sub.next_msg(timeout=5)).data)
    assert error["error"]["code"] == 503


async def test_disconnect_empties_the_pool(coordinator: Coordinator, fleet: DocEngineFleet) -> None:
    await engines_become(coordinator, 2)
    await fleet.leave()
    await engines_become(coordinator, 0)
