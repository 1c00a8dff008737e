"""Backpressure in the engine (engines/requests.py, ``hold``; the intake's ``hold_request``;
the heartbeat's ``held``), on the echo backend and a recording bus: a held request is kept and
not stepped, the newer ``seq`` wins, a release steps it again and wakes the step loop, and
whatever way a request leaves, its hold goes with it."""

from __future__ import annotations

from typing import Any

import msgspec

from engines.backend import Backend, GenerationRequest, TokenOutput
from engines.echo import EchoBackend
from engines.runtime_intake import RequestIntake
from engines.runtime_membership import Membership
from engines.runtime_steps import StepLoop
from service.bus.registry import Incoming
from service.protocol.codec import Encoding
from service.protocol.membership import Heartbeat
from service.protocol.routed import RoutedHold, RoutedRequest
from service.protocol.subjects import Header
from tests.unit.engines.wiring import ENGINE_ID, Floor, build

HOLD = Incoming(Header.HOLD_REQUEST, None, Encoding.MSGPACK, b"")


def start(floor: Floor, max_tokens: int = 10) -> str:
    routed: RoutedRequest = floor.routed(max_tokens=max_tokens, stream=True)
    request_id = routed.return_path.request_id
    floor.requests.start(routed, Encoding.JSON, GenerationRequest(request_id, "abc", max_tokens=max_tokens), None)
    return request_id


async def step(floor: Floor) -> list[str]:
    """One step, recorded; the ids that got a token."""
    outputs = await floor.backend.step()
    await floor.requests.record_step(outputs, None, None)
    return [output.request_id for output in outputs if output.new_tokens]


async def test_a_held_request_stays_but_is_not_stepped_until_released_and_the_newer_seq_wins() -> None:
    floor = build()
    held, other = start(floor), start(floor)
    await step(floor)
    assert floor.requests.hold(held, True, 1)
    assert floor.requests.held_back() == [held] and held in floor.requests and len(floor.requests) == 2
    assert await step(floor) == [other]  # the held one is kept, not stepped
    assert not floor.requests.hold(held, False, 1)  # not newer than the last applied: ignored
    assert not floor.requests.hold(held, True, 3) and floor.requests.hold(held, False, 4)  # held already; released
    assert not floor.requests.hold(held, True, 2)  # a hold that arrives after its release is stale
    assert sorted(await step(floor)) == sorted([held, other])
    assert not floor.requests.hold("c1-unknown", True, 9)
    assert floor.core.counters["holds"] == floor.core.counters["releases"] == 1


async def test_a_held_request_that_leaves_takes_its_hold_with_it() -> None:
    floor = build()
    aborted, finishing = start(floor), start(floor, max_tokens=1)
    floor.requests.hold(aborted, True, 1)
    floor.requests.hold(finishing, True, 1)
    await floor.requests.abort(aborted)
    assert floor.requests.held_back() == [finishing]
    # A step launched before the hold (a backend that launches ahead) may still finish it.
    await floor.requests.record_step([TokenOutput(finishing, [97], "a", "length")], None, None)
    assert floor.requests.held_back() == [] and len(floor.requests) == 0
    assert [body["finish_reason"] for body in floor.bodies()] == ["abort", "length"]


class NotHolding(EchoBackend):
    """Test double of a backend that cannot hold (the interface's default)."""

    def hold(self, request_id: str) -> bool:
        return Backend.hold(self, request_id)


async def test_a_backend_that_cannot_hold_keeps_stepping_the_request() -> None:
    floor = build(NotHolding())
    request_id = start(floor)
    assert not floor.requests.hold(request_id, True, 1)
    assert floor.requests.held_back() == [] and await step(floor) == [request_id]
    assert floor.core.counters["holds_not_applied"] == 1


async def test_the_intakes_hold_request_releases_with_a_wake_and_the_heartbeat_lists_the_held() -> None:
    floor = build(heartbeat_interval_s=0.01)
    intake = RequestIntake(floor.core, floor.requests, floor.control)
    request_id = start(floor)
    floor.core.wake.clear()
    await intake.hold(HOLD, RoutedHold(request_id, True, 1))
    assert not floor.core.wake.is_set() and floor.requests.held_back() == [request_id]
    membership = Membership(floor.core, floor.requests, floor.control, floor.weights, "m", steps=lambda: 0)
    membership.registered.set()
    await membership.heartbeat_once()
    [beat] = floor.bus.on(floor.core.subjects.sent_by(Header.HEARTBEAT, ENGINE_ID))
    heartbeat = msgspec.msgpack.decode(beat.body, type=Heartbeat)
    assert heartbeat.active == [request_id] and heartbeat.held == [request_id]
    await intake.hold(HOLD, RoutedHold(request_id, False, 2))
    assert floor.core.wake.is_set() and floor.requests.held_back() == []


async def test_a_release_that_arrives_while_the_step_loop_publishes_is_not_lost() -> None:
    """Every request held: the step loop publishes the last step's replies and sleeps until
    woken; a release arriving while it publishes keeps the loop awake."""
    floor = build()
    request_id = start(floor)
    floor.core.wake.set()
    steps = StepLoop(floor.core, floor.requests, floor.control, floor.weights)
    await steps.step_once()  # one token, its replies not sent yet
    floor.requests.hold(request_id, True, 1)
    publish = floor.requests.record_step

    async def released_meanwhile(*args: Any) -> None:
        await publish(*args)
        floor.requests.hold(request_id, False, 2)
        floor.core.wake.set()  # as the intake does on a release

    floor.requests.record_step = released_meanwhile  # type: ignore[method-assign,assignment]
    await steps.step_once()  # nothing to step: publishes, then would sleep
    assert floor.core.wake.is_set()
    floor.requests.record_step = publish  # type: ignore[method-assign]
    await steps.step_once()
    assert steps.steps == 2
