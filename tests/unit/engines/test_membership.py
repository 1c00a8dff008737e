"""Membership on a recording bus whose responders answer as a coordinator would: registration
(retried, and after loading the fleet's weights), the control state it brings, heartbeats,
and rejoining."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from engines.backend import GenerationRequest
from engines.runtime_membership import Membership
from service.protocol.codec import Encoding, encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.membership import EngineRegister, Heartbeat, RegisterAck
from service.protocol.messages import error_reply
from service.protocol.subjects import Header
from tests.unit.engines.wiring import ENGINE_ID, Floor, build


def membership(floor: Floor, steps: int = 0) -> Membership:
    return Membership(floor.core, floor.requests, floor.control, floor.weights, "served-name", lambda: steps)


def coordinator_answers(floor: Floor, *answers: bytes) -> Callable[[bytes], list[bytes]]:
    """A responder on the register subject: ``answers`` in turn (an empty one: nobody
    answered), then the last one again."""
    left = list(answers)

    def respond(_: bytes) -> list[bytes]:
        answer = left.pop(0) if len(left) > 1 else left[0]
        return [answer] if answer else []

    floor.bus.responders[floor.core.subjects.sent_by(Header.REGISTER, ENGINE_ID)] = respond
    return respond


def registrations(floor: Floor) -> list[EngineRegister]:
    subject = floor.core.subjects.sent_by(Header.REGISTER, ENGINE_ID)
    return [sent.decode(EngineRegister) for sent in floor.bus.on(subject)]


async def test_registration_brings_the_fleets_control_state_and_wakes_the_step_loop() -> None:
    floor = build()
    coordinator_answers(floor, encode_msgpack(RegisterAck("c1", "paused", 4, revision=2)))
    job = membership(floor)
    await asyncio.wait_for(job.register(), 5)
    assert job.registered.is_set() and floor.core.wake.is_set()
    assert (floor.control.paused, floor.control.epoch, floor.control.revision) == (True, 4, 2)
    [sent] = registrations(floor)
    assert (sent.engine_id, sent.backend, sent.served_model_name, sent.paused) == (
        ENGINE_ID,
        "echo",
        "served-name",
        False,
    )


async def test_registration_retries_until_a_coordinator_adds_the_engine() -> None:
    floor = build()
    refused = encode_msgpack(error_reply(WireError(ErrorCode.OVERLOADED, "pool full"), None))
    coordinator_answers(floor, b"", refused, encode_msgpack(RegisterAck("c1", "running", None)))
    job = membership(floor)
    await asyncio.wait_for(job.register(), 5)
    assert len(registrations(floor)) == 3 and job.registered.is_set() and not floor.control.paused


async def test_an_engine_serving_other_weights_loads_the_fleets_before_it_registers_again(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    floor = build()
    coordinator_answers(
        floor, encode_msgpack(RegisterAck("c1", "running", None, 5, weight_version=2, weight_path=str(tmp_path)))
    )
    await asyncio.wait_for(membership(floor).register(), 5)
    assert [sent.weight_version for sent in registrations(floor)] == [None, 2]
    assert floor.weights.version == 2 and floor.weights.revision == 5


async def test_a_heartbeat_carries_the_requests_held_the_steps_and_the_weights() -> None:
    floor = build(heartbeat_interval_s=0.001)
    routed = floor.routed()
    request_id = routed.return_path.request_id
    floor.requests.start(routed, Encoding.JSON, GenerationRequest(request_id, "abc"), None)
    job = membership(floor, steps=12)
    await job.heartbeat_once()
    subject = floor.core.subjects.sent_by(Header.HEARTBEAT, ENGINE_ID)
    [beat] = [sent.decode(Heartbeat) for sent in floor.bus.on(subject)]
    assert (beat.load, beat.active, beat.steps, beat.served_model_name) == (1, [request_id], 12, "served-name")
    floor.core.connected.clear()
    await job.heartbeat_once()
    floor.core.connected.set()
    job.stop_heartbeats()
    await job.heartbeat_once()
    assert len(floor.bus.on(subject)) == 1  # none while disconnected, none after a stop


async def test_rejoining_leaves_the_pool_and_registers_again_once() -> None:
    floor = build()
    coordinator_answers(floor, encode_msgpack(RegisterAck("c1", "running", None)))
    job = membership(floor)
    assert not job.rejoin()  # not registered: nothing to leave
    await job.register()
    assert job.rejoin() and not job.registered.is_set()
    assert not job.rejoin()  # a registration is under way
    [task] = floor.spawned.tasks
    await asyncio.wait_for(task, 5)
    assert job.registered.is_set() and len(registrations(floor)) == 2
