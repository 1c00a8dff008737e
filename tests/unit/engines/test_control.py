"""Control on the request table alone: pause as a barrier in its three modes, suspend and
resume, stop, signals older than the last applied, and the hand-over of a dead coordinator's
requests; the step loop's and membership's actions are recorded callables."""

from __future__ import annotations

import asyncio

from engines.backend import GenerationRequest
from engines.echo import EchoBackend
from engines.runtime_control import ControlSignals
from service.bus.registry import Incoming
from service.protocol.codec import Encoding
from service.protocol.handover import Adoption
from service.protocol.routed import EngineAck, EngineSignal
from tests.unit.engines.wiring import Floor, build


class Recorded(EchoBackend):
    """Test double: the echo backend, recording the calls control makes on it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def quiesce(self) -> None:
        self.calls.append("quiesce")

    async def suspend(self) -> None:
        self.calls.append("suspend")

    async def resume(self) -> None:
        self.calls.append("resume")


class Wired:
    """ControlSignals with the step loop's ``publish_unsent`` and membership's
    ``stop_heartbeats`` recorded."""

    def __init__(self, floor: Floor) -> None:
        self.actions: list[str] = []
        self.job = ControlSignals(
            floor.core,
            floor.requests,
            floor.control,
            publish_unsent=self._publish_unsent,
            stop_heartbeats=lambda: self.actions.append("stop_heartbeats"),
        )

    async def _publish_unsent(self) -> None:
        self.actions.append("publish_unsent")


def hold(floor: Floor, coordinator_id: str = "c1") -> str:
    routed = floor.routed(coordinator_id=coordinator_id)
    request_id = routed.return_path.request_id
    floor.requests.start(routed, Encoding.JSON, GenerationRequest(request_id, "abc", max_tokens=3), None)
    return request_id


async def test_pause_keeps_the_requests_and_returns_with_nothing_unsent_and_the_device_idle() -> None:
    backend = Recorded()
    floor = build(backend)
    hold(floor)
    control = Wired(floor)
    await control.job.pause()
    assert floor.control.paused and len(floor.requests) == 1
    assert control.actions == ["publish_unsent"] and backend.calls == ["quiesce"]
    await control.job.unpause()
    assert not floor.control.paused and floor.core.wake.is_set()


async def test_pause_abort_ends_every_request_with_an_abort_final() -> None:
    floor = build()
    hold(floor)
    hold(floor)
    await Wired(floor).job.pause("abort")
    assert [body["finish_reason"] for body in floor.bodies()] == ["abort", "abort"] and len(floor.requests) == 0


async def test_pause_drain_returns_once_the_requests_in_flight_finished() -> None:
    floor = build()
    hold(floor)
    paused = asyncio.ensure_future(Wired(floor).job.pause("drain"))
    await asyncio.sleep(0)
    assert not paused.done() and not floor.control.paused
    for _ in range(3):
        await floor.requests.record_step(await floor.backend.step(), None, None)
    await asyncio.wait_for(paused, 1)
    assert floor.control.paused and floor.bodies()[0]["finish_reason"] == "length"


async def test_suspend_frees_the_backends_memory_and_keeps_the_requests() -> None:
    backend = Recorded()
    floor = build(backend)
    hold(floor)
    control = Wired(floor)
    await control.job.suspend()
    await control.job.resume()
    assert floor.control.paused and len(floor.requests) == 1 and backend.calls == ["suspend", "resume"]


async def test_stop_fails_every_request_and_silences_the_heartbeats() -> None:
    floor = build()
    hold(floor)
    control = Wired(floor)
    assert await control.job.stop_serving() == "1 requests failed"
    assert floor.bodies()[0]["error"]["code"] == 503 and control.actions == ["stop_heartbeats"]
    assert floor.control.paused and len(floor.requests) == 0


async def test_a_signal_not_newer_than_the_last_applied_is_superseded_and_counted() -> None:
    floor = build()
    job = Wired(floor).job
    assert job.superseded(EngineSignal(epoch=7, revision=3)) is None
    assert (floor.control.revision, floor.control.epoch) == (3, 7)
    assert job.superseded(EngineSignal(epoch=1, revision=3)) == "superseded by revision 3"
    assert job.superseded(EngineSignal()) is None  # no revision: always applied
    assert floor.control.epoch == 7 and floor.core.counters["superseded_signals"] == 1


async def test_hand_over_answers_with_the_dead_coordinators_requests() -> None:
    floor = build()
    dead = hold(floor, "c-dead")
    hold(floor, "c-alive")
    incoming = Incoming("adopt", "_INBOX.adopter.1", Encoding.MSGPACK, b"")
    await Wired(floor).job.hand_over(incoming, Adoption("c-dead", "c-adopter"))
    ack = floor.bus.on("_INBOX.adopter.1")[0].decode(EngineAck)
    assert ack.ok and ack.detail == "1 requests" and ack.adopted is not None
    assert [(item.return_path.request_id, item.return_path.coordinator_id) for item in ack.adopted] == [
        (dead, "c-adopter")
    ]


async def test_the_profiler_answers_what_the_backend_says() -> None:
    job = Wired(build()).job
    assert job.start_profiler() == job.stop_profiler() == "echo backend has no profiler"
