"""The request ledger's transitions, alone: admit, route, release, requeue, adopt, finish, fail,
abort and the deadline, each leaving the table, the queue, the slots and the tallies in step."""

from __future__ import annotations

from service.coordinator.requests import InflightRequest
from service.protocol.errors import ErrorCode, WireError
from service.protocol.state import CoordinatorState
from service.protocol.subjects import Header
from tests.helpers import until
from tests.unit.coordinator.conftest import Later
from tests.unit.coordinator.wiring import Floor, build, reply


def admit(floor: Floor, entry: InflightRequest, timeout_s: float | None = None) -> InflightRequest:
    """Admit ``entry`` as admission does: to the engine the ledger offers, else queued."""
    group = floor.pool.group(entry.model)
    floor.ledger.admit(entry, timeout_s, floor.ledger.engine_for(group, entry.model, None))
    return entry


async def test_routed_requests_leave_as_one_batch_per_engine_and_hold_their_slots() -> None:
    floor = build()
    engine = floor.engine("e1", capacity=4)
    first, second = admit(floor, floor.request()), admit(floor, floor.request())
    assert floor.ledger.routed.is_set()
    assert floor.ledger.take_routed() == {"e1": [first, second]}
    assert not floor.ledger.routed.is_set() and not floor.ledger.routing
    assert engine.load == 2 and floor.ledger.held_by("_INBOX") == 2
    assert first.engine_id == "e1" and first.attempts == 1 and floor.core.counters["submitted"] == 2


async def test_finishing_a_request_routes_the_next_waiting_one_without_any_callback() -> None:
    floor = build()
    engine = floor.engine("e1", capacity=1)
    first = admit(floor, floor.request())
    waiting = admit(floor, floor.request())
    assert waiting.engine_id is None and floor.ledger.queued == 1
    floor.ledger.take_routed()
    assert floor.ledger.finish(first.return_path.request_id) is first
    assert (
        waiting.engine_id == "e1" and floor.ledger.queued == 0 and engine.requests == {waiting.return_path.request_id}
    )
    assert floor.ledger.take_routed() == {"e1": [waiting]}
    assert floor.ledger.finish(first.return_path.request_id) is None  # the right to answer is taken once


async def test_while_requests_of_a_model_wait_new_ones_queue_behind_them() -> None:
    floor = build()
    floor.engine("e1", capacity=4)
    floor.control.state = CoordinatorState.PAUSED
    queued = admit(floor, floor.request())
    floor.control.state = CoordinatorState.RUNNING
    assert floor.ledger.engine_for(floor.pool.everyone, None, None) is None  # the waiting one goes first
    floor.ledger.release()
    assert queued.engine_id == "e1"
    assert floor.ledger.engine_for(floor.pool.everyone, None, None) is not None


async def test_a_requeued_request_starts_a_new_run_first_in_line_and_frees_its_slot() -> None:
    floor = build()
    engine = floor.engine("e1", capacity=1)
    lost = admit(floor, floor.request())
    behind = admit(floor, floor.request())
    floor.ledger.requeue(lost)
    assert lost.engine_id is None and engine.load == 0 and floor.ledger.held_by("_INBOX") == 0
    assert lost.earlier_engines == ["e1"] and floor.ledger.queued == 2
    floor.ledger.release()
    assert lost.engine_id == "e1" and behind.engine_id is None  # it kept its turn
    assert lost.attempt == 1 and lost.migrations == 0
    floor.ledger.requeue(lost, migrated=True)
    assert lost.migrations == 1


async def test_fail_answers_once_and_tells_the_engine_to_drop_it() -> None:
    floor = build()
    floor.engine("e1")
    entry = admit(floor, floor.request())
    request_id = entry.return_path.request_id
    assert await floor.ledger.fail(request_id, WireError(ErrorCode.NO_ENGINE, "gone"))
    assert not await floor.ledger.fail(request_id, WireError(ErrorCode.NO_ENGINE, "again"))
    [answer] = floor.bus.to(entry.return_path.reply_to)
    assert answer.json()["type"] == "error" and answer.json()["error"]["code"] == 503
    [abort] = floor.bus.on(floor.core.subjects.engine("e1", Header.ABORT_REQUEST))
    assert abort.decode()["request_id"] == request_id
    assert floor.core.counters["failed_503"] == 1 and floor.core.counters["completed"] == 1
    assert len(floor.ledger) == 0 and floor.pool.get("e1").load == 0  # type: ignore[union-attr]


async def test_a_final_that_came_early_is_the_better_answer_than_an_error() -> None:
    floor = build()
    floor.engine("e1")
    entry = admit(floor, floor.request(stream=True))
    entry.early_final = reply(entry, b'{"type":"final","early":true}', seq=3)
    await floor.ledger.fail(entry.return_path.request_id, WireError(ErrorCode.TIMED_OUT, "late"))
    final, end = floor.bus.to(entry.return_path.reply_to)
    assert final.json()["early"] is True and end.body == b""
    assert floor.core.counters["failed_504"] == 0


async def test_abort_ends_a_queued_request_here_and_asks_the_engine_for_a_routed_one() -> None:
    floor = build()
    floor.engine("e1", capacity=1)
    routed = admit(floor, floor.request())
    queued = admit(floor, floor.request())
    await floor.ledger.abort(queued)
    [final] = floor.bus.to(queued.return_path.reply_to)
    assert final.json()["finish_reason"] == "abort" and queued.return_path.request_id not in floor.ledger
    await floor.ledger.abort(routed)
    assert routed.return_path.request_id in floor.ledger  # its engine's final ends it
    assert len(floor.bus.on(floor.core.subjects.engine("e1", Header.ABORT_REQUEST))) == 1


async def test_the_deadline_fails_the_request_with_504() -> None:
    floor = build()
    floor.engine("e1")
    entry = admit(floor, floor.request(), timeout_s=0.05)
    await until(lambda: bool(floor.spawned.tasks))
    await floor.spawned.settle()
    [answer] = floor.bus.to(entry.return_path.reply_to)
    assert answer.json()["error"]["code"] == 504 and len(floor.ledger) == 0


async def test_waiting_requests_no_engine_serves_fail_once_the_fleet_is_known(later: Later) -> None:
    floor = build()
    waiting = floor.request(model="m")
    floor.ledger.admit(waiting, None, None)
    assert floor.ledger.queued == 1  # before warm-up, heartbeats may yet introduce the fleet
    later.advance(floor.settings.heartbeat_timeout_s)
    floor.ledger.release()
    await floor.spawned.settle()
    [answer] = floor.bus.to(waiting.return_path.reply_to)
    assert answer.json()["error"]["code"] == 404 and floor.ledger.queued == 0 and len(floor.ledger) == 0


async def test_an_owner_over_its_share_is_passed_over_while_others_wait() -> None:
    floor = build(max_client_share=0.5)
    floor.engine("e1", capacity=2)
    admit(floor, floor.request("_INBOX_alice"))  # alice holds one of the fleet's two slots: her share
    floor.control.state = CoordinatorState.PAUSED
    alice = admit(floor, floor.request("_INBOX_alice"))
    bob = admit(floor, floor.request("_INBOX_bob"))
    floor.control.state = CoordinatorState.RUNNING
    floor.ledger.release()
    assert bob.engine_id == "e1" and alice.engine_id is None


async def test_an_adopted_request_is_held_as_if_routed_here() -> None:
    floor = build()
    engine = floor.engine("e1")
    entry = floor.request(coordinator_id="c0")
    assert floor.ledger.hold_adopted(entry, "e1", attempt=1)
    assert not floor.ledger.hold_adopted(entry, "e1", attempt=1)
    assert entry.attempts == 2 and entry.engine_id == "e1" and engine.load == 1 and floor.ledger.held_by("_INBOX") == 1
    assert floor.ledger.finish(entry.return_path.request_id) is entry
    assert engine.load == 0 and floor.ledger.held_by("_INBOX") == 0


async def test_a_resubmission_repoints_the_replies() -> None:
    floor = build()
    floor.engine("e1")
    entry = admit(floor, floor.request())
    floor.ledger.repoint(entry, "_INBOX.elsewhere", stream=True)
    assert entry.return_path.reply_to == "_INBOX.elsewhere" and entry.return_path.stream
