"""Control on the ledger alone, with the control record kept in memory (no JetStream): the
transition table decides, engines confirm through the broadcast, queued requests are routed
when the record reaches running, and a finished stop forgets the engines."""

from __future__ import annotations

import msgspec
import pytest

from service.bus.registry import Incoming
from service.coordinator.control import Control
from service.protocol.codec import Encoding, encode_msgpack
from service.protocol.errors import WireError
from service.protocol.messages import ControlSignal
from service.protocol.routed import EngineAck
from service.protocol.state import CoordinatorState
from service.protocol.subjects import Header
from tests.unit.coordinator.wiring import Floor, build


class Calls:
    """What control asked of the coordinator's other jobs (the fleet forgetting engines, the
    coordinator stopping)."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.stops = 0

    async def forget_engines(self, reason: str) -> None:
        self.forgotten.append(reason)

    def request_stop(self) -> None:
        self.stops += 1


def control(floor: Floor, calls: Calls) -> Control:
    return Control(
        floor.core,
        floor.ledger,
        floor.control,
        floor.pool,
        floor.peers,
        forget_engines=calls.forget_engines,
        request_stop=calls.request_stop,
    )


def confirming(floor: Floor, signal: Header, *engine_ids: str) -> None:
    """Engines ``engine_ids`` confirm ``signal`` when it is broadcast."""
    floor.bus.responders[floor.core.subjects.broadcast(signal)] = lambda body: [
        encode_msgpack(EngineAck(engine_id, signal.value)) for engine_id in engine_ids
    ]


def incoming(signal: Header) -> Incoming:
    return Incoming(signal, "_INBOX.admin.1", Encoding.JSON, b"{}", None, "_INBOX")


async def signal(job: Control, header: Header) -> None:
    payload = ControlSignal()
    await job.control_engines(incoming(header), header, payload, await job.apply(header, payload))


async def test_a_signal_the_table_forbids_is_refused_with_409_and_changes_nothing() -> None:
    floor = build()
    job = control(floor, Calls())
    with pytest.raises(WireError) as refusal:
        await job.apply(Header.SUSPEND, ControlSignal())
    assert refusal.value.code == 409 and floor.control.state is CoordinatorState.RUNNING


async def test_a_signal_is_acknowledged_once_every_engine_confirmed_it() -> None:
    floor = build()
    job = control(floor, Calls())
    floor.engine("e1")
    floor.engine("e2")
    confirming(floor, Header.PAUSE, "e1", "e2")
    await signal(job, Header.PAUSE)
    [ack] = floor.bus.to("_INBOX.admin.1")
    assert ack.json()["type"] == "ack" and ack.json()["state"] == "paused"
    assert floor.control.state is CoordinatorState.PAUSED


async def test_an_engine_that_does_not_confirm_is_named_in_a_504_and_the_change_stands() -> None:
    floor = build(control_timeout_s=0.05)
    job = control(floor, Calls())
    floor.engine("e1")
    floor.engine("mute")
    confirming(floor, Header.PAUSE, "e1")
    await signal(job, Header.PAUSE)
    [answer] = floor.bus.to("_INBOX.admin.1")
    error = msgspec.json.decode(answer.body)["error"]
    assert error["code"] == 504 and "mute" in error["message"] and floor.control.state is CoordinatorState.PAUSED


async def test_requests_queued_while_paused_are_routed_when_the_record_runs_again() -> None:
    floor = build()
    job = control(floor, Calls())
    floor.engine("e1")
    confirming(floor, Header.PAUSE, "e1")
    confirming(floor, Header.UNPAUSE, "e1")
    await signal(job, Header.PAUSE)
    waiting = floor.request()
    floor.ledger.admit(waiting, None, floor.ledger.engine_for(floor.pool.everyone, None, None))
    assert waiting.engine_id is None
    await signal(job, Header.UNPAUSE)
    await floor.spawned.settle()
    assert waiting.engine_id == "e1" and job.changed.is_set()


async def test_a_finished_stop_forgets_every_engine_and_runs_again() -> None:
    floor = build()
    calls = Calls()
    job = control(floor, calls)
    floor.engine("e1")
    for header in (Header.PAUSE, Header.STOP):
        confirming(floor, header, "e1")
        await signal(job, header)
    await floor.spawned.settle()
    assert "stopped" in calls.forgotten and floor.control.state is CoordinatorState.RUNNING
    assert [answer.json()["state"] for answer in floor.bus.to("_INBOX.admin.1")] == [
        "paused",
        "stopping",
    ]  # what the stop wrote


async def test_a_shutdown_stops_this_replica_too() -> None:
    floor = build()
    calls = Calls()
    job = control(floor, calls)
    written, replicas = await job.shut_down_all()
    assert written.changed and replicas == 1 and job.fleet_shutdown and calls.stops == 1


async def test_a_retry_that_finds_its_signal_done_is_broadcast_again_and_acknowledged() -> None:
    """Issue 34, 3: the replica that took ``unpause`` died before answering; its retry, on this
    replica, finds the record ``unpause`` wrote, so it is neither refused (409) nor acknowledged
    before every engine confirmed it again under that revision."""
    floor = build()
    job = control(floor, Calls())
    floor.engine("e1")
    confirming(floor, Header.PAUSE, "e1")
    confirming(floor, Header.UNPAUSE, "e1")
    await signal(job, Header.PAUSE)
    await signal(job, Header.UNPAUSE)
    retry = ControlSignal(retry=True)
    written = await job.apply(Header.UNPAUSE, retry)
    assert not written.changed and written.record.state is CoordinatorState.RUNNING
    await job.control_engines(incoming(Header.UNPAUSE), Header.UNPAUSE, retry, written)
    first, again = floor.bus.on(floor.core.subjects.broadcast(Header.UNPAUSE))
    assert first.body == again.body  # the same signal: under JetStream, the same revision
    assert floor.bus.to("_INBOX.admin.1")[-1].json() == {
        "type": "ack",
        "signal": "unpause",
        "state": "running",
        "revision": written.revision,
    }
    with pytest.raises(WireError) as refusal:  # a repeat that is no retry is judged by the table
        await job.apply(Header.UNPAUSE, ControlSignal())
    assert refusal.value.code == 409


async def test_a_stops_retry_after_the_stop_ended_is_acknowledged_and_forgets_no_engine() -> None:
    floor = build()
    calls = Calls()
    job = control(floor, calls)
    floor.engine("e1")
    for header in (Header.PAUSE, Header.STOP):
        confirming(floor, header, "e1")
        await signal(job, header)
    await floor.spawned.settle()
    forgotten, stops = len(calls.forgotten), len(floor.bus.on(floor.core.subjects.broadcast(Header.STOP)))
    floor.engine("e2")  # joined since
    retry = ControlSignal(retry=True)
    await job.control_engines(incoming(Header.STOP), Header.STOP, retry, await job.apply(Header.STOP, retry))
    await floor.spawned.settle()
    assert floor.bus.to("_INBOX.admin.1")[-1].json()["state"] == "running"
    assert len(calls.forgotten) == forgotten and len(floor.bus.on(floor.core.subjects.broadcast(Header.STOP))) == stops
