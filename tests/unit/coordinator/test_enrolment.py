"""Enrolment on the ledger alone: an engine on the fleet's weights joins and the queue is
released to it; one on other weights is told which to load and is not added."""

from __future__ import annotations

from service.bus.registry import Incoming
from service.coordinator.enrolment import Enrolment
from service.coordinator.fleet import Fleet
from service.coordinator.shared_state import SharedControlState
from service.coordinator.weights import WeightUpdates
from service.protocol.codec import Encoding
from service.protocol.membership import RegisterAck
from service.protocol.subjects import Header
from tests.unit.coordinator.wiring import Floor, build


def enrolment(floor: Floor) -> Enrolment:
    fleet = Fleet(floor.core, floor.ledger, floor.pool, floor.control)
    shared = SharedControlState(floor.core.subjects.prefix, floor.core.id, 1.0, lambda previous, current: None)

    async def nothing(*_: object) -> None:
        return None

    weights = WeightUpdates(floor.core, shared, floor.pool, nothing, nothing)
    return Enrolment(floor.core, floor.ledger, floor.control, shared, fleet, weights)


def register(engine_id: str) -> Incoming:
    return Incoming(Header.REGISTER, f"_INBOX.{engine_id}", Encoding.MSGPACK, b"", engine_id, "_INBOX")


async def test_an_engine_on_the_fleets_weights_joins_and_takes_what_waited() -> None:
    floor = build()
    job = enrolment(floor)
    waiting = floor.request()
    floor.ledger.admit(waiting, None, None)
    await job.register(register("e1"), "e1", 4, None, None)
    [ack] = floor.bus.to("_INBOX.e1")
    assert ack.decode(RegisterAck).state == "running" and floor.pool.get("e1") is not None
    assert waiting.engine_id == "e1"


async def test_an_engine_on_other_weights_is_told_the_fleets_and_not_added() -> None:
    floor = build()
    floor.control.weight_version, floor.control.weight_path = "v2", "/weights/v2"
    job = enrolment(floor)
    await job.register(register("e1"), "e1", 4, None, "v1")
    [ack] = floor.bus.to("_INBOX.e1")
    answer = ack.decode(RegisterAck)
    assert (answer.weight_version, answer.weight_path) == ("v2", "/weights/v2") and floor.pool.get("e1") is None
    assert floor.core.counters["engines_on_other_weights"] == 1
