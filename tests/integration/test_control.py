"""Control and profiler signals: acknowledged after every engine confirmed, held submissions, stop."""

from __future__ import annotations

import json

import msgpack
from nats.aio.client import Client as NATS

from service.coordinator.coordinator import Coordinator
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineRegister
from service.protocol.state import CoordinatorState
from tests.conftest import EngineFactory
from tests.helpers import decode_reply, request_json


def subject(coordinator: Coordinator, header: str) -> str:
    return coordinator.subjects.coordinator(header)


async def barrier(nc: NATS, coordinator: Coordinator) -> None:
    """A refused submission: once its error is back, earlier submissions were handled."""
    reply = await request_json(nc, subject(coordinator, "submit_request"), {"prompt": 0})
    assert reply["error"]["code"] == 400


async def test_paused_submissions_are_held_then_served_after_unpause(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    engines = await start_engines(2)
    assert (await request_json(nc, subject(coordinator, "pause"), {}))["state"] == "paused"
    assert all(engine.paused for engine in engines)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    for i in range(5):
        await nc.publish(
            subject(coordinator, "submit_request"),
            json.dumps({"prompt": f"p{i}", "client_request_id": i}).encode(),
            reply=inbox,
        )
    await barrier(nc, coordinator)
    assert sub.pending_msgs == 0
    assert len(coordinator.requests) == 5 and all(engine.load == 0 for engine in engines)

    assert (await request_json(nc, subject(coordinator, "unpause"), {}))["state"] == "running"
    finals = [decode_reply((await sub.next_msg(timeout=5)).data) for _ in range(5)]
    assert sorted(final["client_request_id"] for final in finals) == list(range(5))
    assert all(final["type"] == "final" for final in finals)


async def test_suspend_and_resume_hold_submissions(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    for signal, state in [("pause", "paused"), ("suspend", "suspended")]:
        assert (await request_json(nc, subject(coordinator, signal), {}))["state"] == state
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject(coordinator, "submit_request"), b'{"prompt": "held"}', reply=inbox)
    await barrier(nc, coordinator)
    for signal, state in [("resume", "paused"), ("unpause", "running")]:
        assert (await request_json(nc, subject(coordinator, signal), {}))["state"] == state
    assert decode_reply((await sub.next_msg(timeout=5)).data)["generated_text"].startswith("held")


async def test_engine_joining_while_paused_starts_paused(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await request_json(nc, subject(coordinator, "pause"), {})
    [engine] = await start_engines(1)
    assert engine.paused


async def test_generation_epoch_is_recorded_in_final_replies(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    ack = await request_json(nc, subject(coordinator, "set_generation_epoch"), {"epoch": 7})
    assert ack == {"type": "ack", "signal": "set_generation_epoch", "state": "running", "epoch": 7, "revision": 2}
    final = await request_json(
        nc, subject(coordinator, "submit_request"), {"prompt": "e", "sampling_params": {"max_tokens": 3}}
    )
    assert final["epochs"] == [{"epoch": 7, "start": 0, "end": 3}]
    missing = await request_json(nc, subject(coordinator, "set_generation_epoch"), {})
    assert missing["error"]["code"] == 400
    wrong = await request_json(nc, subject(coordinator, "set_generation_epoch"), {"epoch": "8"})
    assert wrong["error"]["code"] == 400


async def test_epoch_change_mid_request_splits_spans(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1, token_delay_ms=20)
    await request_json(nc, subject(coordinator, "set_generation_epoch"), {"epoch": 1})
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"prompt": "abc", "stream": True, "sampling_params": {"max_tokens": 6}}
    await nc.publish(subject(coordinator, "submit_request"), json.dumps(body).encode(), reply=inbox)
    first = decode_reply((await sub.next_msg(timeout=5)).data)
    assert first["type"] == "partial"
    await request_json(nc, subject(coordinator, "set_generation_epoch"), {"epoch": 2})
    while (msg := await sub.next_msg(timeout=5)).data:
        reply = decode_reply(msg.data)
    spans = reply["epochs"]
    assert [span["epoch"] for span in spans] == [1, 2]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 6


async def test_profiler_signals_are_acked_by_every_engine(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    engines = await start_engines(2)
    for signal in ("start_cuda_profiler", "stop_cuda_profiler"):
        ack = await request_json(nc, subject(coordinator, signal), {})
        assert ack["type"] == "ack" and ack["signal"] == signal
        assert set(ack["engines"]) == {engine.engine_id for engine in engines}


async def test_control_in_msgpack_is_answered_in_msgpack(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    msg = await nc.request(subject(coordinator, "pause"), msgpack.packb({}), timeout=5)
    assert msgpack.unpackb(msg.data) == {"type": "ack", "signal": "pause", "state": "paused", "revision": 2}


async def test_stop_fails_in_flight_requests_and_engines_exit(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    engines = await start_engines(2, token_delay_ms=20)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"prompt": "long", "stream": True, "sampling_params": {"max_tokens": 1000}}
    await nc.publish(subject(coordinator, "submit_request"), json.dumps(body).encode(), reply=inbox)
    assert decode_reply((await sub.next_msg(timeout=5)).data)["type"] == "partial"
    await request_json(nc, subject(coordinator, "pause"), {})
    assert (await request_json(nc, subject(coordinator, "stop"), {}))["state"] == "stopping"
    for engine in engines:
        await engine.run_until_stopped()
    assert coordinator.state is CoordinatorState.RUNNING and len(coordinator.engines) == 0
    while (msg := await sub.next_msg(timeout=5)).data:
        terminal = decode_reply(msg.data)
    assert terminal["type"] == "error" and terminal["error"]["code"] == 503
    assert (await request_json(nc, subject(coordinator, "submit_request"), {"prompt": "x"}))["error"]["code"] == 503
    [fresh] = await start_engines(1)
    assert (await request_json(nc, subject(coordinator, "submit_request"), {"prompt": "x"}))[
        "engine_id"
    ] == fresh.engine_id


async def test_unconfirmed_signal_gets_504_naming_the_engine_and_state_stands(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    silent = EngineRegister("silent-engine")
    await nc.request(coordinator.subjects.sent_by("register", silent.engine_id), encode_msgpack(silent), timeout=5)
    reply = await request_json(nc, subject(coordinator, "pause"), {}, timeout=10)
    assert reply["type"] == "error" and reply["error"]["code"] == 504
    assert "silent-engine" in reply["error"]["message"]
    assert coordinator.state is CoordinatorState.PAUSED


async def test_shutdown_acks_and_fails_open_requests(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    await start_engines(1)
    await request_json(nc, subject(coordinator, "pause"), {})
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject(coordinator, "submit_request"), b'{"prompt": "held", "stream": true}', reply=inbox)
    await barrier(nc, coordinator)
    assert (await request_json(nc, subject(coordinator, "connect"), {}))["type"] == "connect_ack"  # a known client
    assert (await request_json(nc, subject(coordinator, "shutdown"), {}))["signal"] == "shutdown"
    await coordinator.run_until_stopped()
    await coordinator.stop()
    messages = [await sub.next_msg(timeout=5), await sub.next_msg(timeout=5)]
    assert decode_reply(messages[0].data)["error"]["code"] == 503 and messages[1].data == b""


async def test_control_ack_json_stream_of_replies(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """A control reply is a single message, never followed by an empty one."""
    await start_engines(1)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject(coordinator, "pause"), b"", reply=inbox)
    assert decode_reply((await sub.next_msg(timeout=5)).data)["type"] == "ack"
    await request_json(nc, subject(coordinator, "pause"), {})
    assert sub.pending_msgs == 0
