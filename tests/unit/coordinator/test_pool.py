"""The engine pool's bookkeeping in O(1) (membership, loads, silence, departures) and the
join/leave log summed per second. No bus needed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest

from service.coordinator.fleet_log import FleetLog
from service.coordinator.pool import EnginePool, EngineRecord


def full_pool(count: int, capacity: int = 4) -> EnginePool:
    pool = EnginePool(max_inflight_per_engine=256, departed_memory_s=60.0)
    for index in range(count):
        pool.add(f"e{index}", capacity)
    return pool


def test_removal_keeps_every_other_engine_findable_and_sampled() -> None:
    pool = full_pool(6)
    for engine_id in ("e0", "e5", "e2"):
        removed = pool.remove(engine_id, departed=True)
        assert removed is not None and not removed.in_pool
    assert sorted(record.engine_id for record in pool) == ["e1", "e3", "e4"]
    assert all(pool.get(record.engine_id) is record for record in pool)
    assert {engine for _ in range(200) for engine in pool.everyone.sample_two()} == set(pool)
    assert pool.remove("e0", departed=True) is None


def test_sample_two_draws_two_distinct_engines() -> None:
    pool = full_pool(2)
    assert all(len({id(record) for record in pool.everyone.sample_two()}) == 2 for _ in range(50))
    single = full_pool(1)
    assert single.everyone.sample_two() == (single.get("e0"), single.get("e0"))


def test_capacity_is_capped_by_the_coordinator_setting() -> None:
    pool = EnginePool(max_inflight_per_engine=2, departed_memory_s=1.0)
    record = pool.add("big", 1000)
    assert record.capacity == 2
    pool.assign(record, "a")
    pool.assign(record, "b")
    assert not record.has_room and pool.everyone.least_loaded() is None and pool.everyone.next_in_turn() is None


def test_assign_and_release_are_idempotent() -> None:
    pool = full_pool(2)
    e0 = pool.get("e0")
    assert e0 is not None
    pool.assign(e0, "r")
    pool.assign(e0, "r")
    assert e0.load == 1 and pool.everyone.least_loaded() is pool.get("e1")
    assert pool.release(e0.engine_id, "r") and not pool.release(e0.engine_id, "r")
    assert e0.load == 0


def test_a_removed_engine_keeps_its_requests_but_leaves_every_index() -> None:
    pool = full_pool(1)
    record = pool.get("e0")
    assert record is not None
    pool.assign(record, "r")
    pool.remove("e0", departed=False)
    assert record.requests == {"r"}
    assert pool.everyone.least_loaded() is None and pool.everyone.next_in_turn() is None and len(pool) == 0
    assert not pool.release("e0", "r")  # a late answer for the removed engine changes nothing
    again = pool.add("e0", 4)  # the engine registers again: its new record never held "r"
    assert not pool.release("e0", "r") and again.load == 0 and pool.everyone.least_loaded() is again


def test_silent_engines_are_found_without_reading_the_others() -> None:
    pool = full_pool(5)
    for engine_id in ("e1", "e3"):
        pool.heard(pool.get(engine_id))  # type: ignore[arg-type]
    heard_at = pool.get("e1").last_seen  # type: ignore[union-attr]
    assert [record.engine_id for record in pool.silent_since(heard_at)] == ["e0", "e2", "e4"]
    pool.heard_all()
    assert pool.silent_since(time.monotonic() - 1.0) == []


def test_departed_engines_are_remembered_for_a_while() -> None:
    pool = EnginePool(max_inflight_per_engine=4, departed_memory_s=60.0)
    pool.add("gone", 4)
    pool.add("silent", 4)
    pool.remove("gone", departed=True)
    pool.remove("silent", departed=False)
    assert pool.recently_departed("gone") and not pool.recently_departed("silent")
    pool.add("gone", 4)
    assert not pool.recently_departed("gone")  # registering again is welcome
    forgetful = EnginePool(max_inflight_per_engine=4, departed_memory_s=0.0)
    forgetful.add("gone", 4)
    forgetful.remove("gone", departed=True)
    assert not forgetful.recently_departed("gone")


def test_least_loaded_walks_up_past_emptied_buckets() -> None:
    pool = EnginePool(max_inflight_per_engine=256, departed_memory_s=60.0)
    a, b = pool.add("a", 10), pool.add("b", 10)
    for index in range(3):
        pool.assign(b, f"b{index}")
    assert pool.everyone.least_loaded() is a and pool.everyone.lowest_load == 0
    pool.assign(a, "a0")
    pool.assign(a, "a1")
    assert pool.everyone.least_loaded() is a and pool.everyone.lowest_load == 2
    pool.assign(a, "a2")
    pool.assign(a, "a3")
    assert pool.everyone.least_loaded() is b and pool.everyone.lowest_load == 3
    pool.release(a.engine_id, "a0")
    pool.release(a.engine_id, "a1")
    assert pool.everyone.least_loaded() is a and pool.everyone.lowest_load == 2
    pool.remove("a", departed=True)
    assert pool.everyone.least_loaded() is b and pool.everyone.lowest_load == 3


def test_pool_records_compare_by_identity() -> None:
    assert EngineRecord("same", 4) != EngineRecord("same", 4)


# ---------------------------------------------------------------- join and leave log


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.summed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        if " more engines " in line:
            self.summed.set()


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("tests.fleet_log")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


async def test_a_burst_of_joins_is_one_line_then_one_sum(lines: Lines) -> None:
    fleet_log = FleetLog(logging.getLogger("tests.fleet_log"), interval_s=0.2)
    for index in range(1000):
        fleet_log.joined(f"e{index}", "m", 256, index + 1)
    assert lines.lines == ["engine_id=e0 joined (model m, capacity 256, 1 engines)"]
    await asyncio.wait_for(lines.summed.wait(), 5)
    assert lines.lines[1] == "999 more engines joined in the last 0.2 s, the last engine_id=e999 (1000 engines)"


async def test_a_burst_of_removals_is_summed_by_reason(lines: Lines) -> None:
    fleet_log = FleetLog(logging.getLogger("tests.fleet_log"), interval_s=0.2)
    for index in range(30):
        fleet_log.removed(f"e{index}", "shutdown" if index % 3 else "no heartbeat", 2, 29 - index)
    assert lines.lines == ["engine_id=e0 removed (no heartbeat); 2 requests in flight"]
    await asyncio.wait_for(lines.summed.wait(), 5)
    assert lines.lines[1] == (
        "29 more engines removed in the last 0.2 s (20 shutdown, 9 no heartbeat), the last engine_id=e29; "
        "58 requests in flight; 0 engines"
    )


def test_each_model_has_its_own_group_kept_in_step_with_the_fleet() -> None:
    pool = EnginePool(max_inflight_per_engine=256, departed_memory_s=60.0)
    a1, a2, b1, anon = (
        pool.add("a1", 2, "alpha"),
        pool.add("a2", 2, "alpha"),
        pool.add("b1", 2, "beta"),
        pool.add("x", 2),
    )
    alpha = pool.group("alpha")
    assert alpha is not None and set(alpha) == {a1, a2} and set(pool.everyone) == {a1, a2, b1, anon}
    assert pool.group("gamma") is None and pool.models() == ["alpha", "beta"]
    pool.assign(a1, "r1")
    pool.assign(a1, "r2")  # a1 is full now, in every group it belongs to
    assert alpha.least_loaded() is a2 and a1 not in {alpha.next_in_turn(), alpha.next_in_turn()}
    assert pool.everyone.least_loaded() is not a1
    assert [(m.name, m.engines, m.capacity, m.in_flight) for m in pool.served()] == [
        ("alpha", 2, 4, 2),
        ("beta", 1, 2, 0),
    ]
    pool.release("a1", "r1")
    assert a1 in {alpha.next_in_turn(), alpha.next_in_turn()}
    pool.remove("b1", departed=True)
    assert pool.group("beta") is None and pool.models() == ["alpha"]


async def test_a_stopping_coordinator_logs_what_it_was_summing(lines: Lines) -> None:
    fleet_log = FleetLog(logging.getLogger("tests.fleet_log"), interval_s=0.2)
    for index in range(3):
        fleet_log.removed(f"e{index}", "shutdown", 0, 2 - index)
    fleet_log.flush()
    assert lines.lines[1:] == [
        "2 more engines removed in the last 0.2 s (2 shutdown), the last engine_id=e2; 0 requests in flight; 0 engines"
    ]
    past_the_interval = asyncio.Event()  # set after the flushed interval's own timer has fired
    asyncio.get_running_loop().call_later(0.25, past_the_interval.set)
    await asyncio.wait_for(past_the_interval.wait(), 5)
    assert len(lines.lines) == 2  # that timer found nothing left to sum
