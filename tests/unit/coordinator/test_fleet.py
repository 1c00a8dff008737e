"""The fleet on the ledger alone: engines join and leave, a lost engine's requests are retried,
migrated or failed through the ledger, silence and stalls are watched, and what an engine
never received is found by reconciliation."""

from __future__ import annotations

import asyncio

import pytest

from service.coordinator import stalls
from service.coordinator.fleet import Fleet
from service.coordinator.requests import InflightRequest
from service.coordinator.stalls import Stalls
from service.protocol.codec import encode_msgpack
from service.protocol.errors import WireError
from service.protocol.membership import Heartbeat, ResendAnswer
from service.protocol.subjects import RESEND_REPLIES, Header
from tests.unit.coordinator.conftest import Later
from tests.unit.coordinator.wiring import Floor, build


def fleet(floor: Floor) -> Fleet:
    return Fleet(floor.core, floor.ledger, floor.pool, floor.control)


def admitted(floor: Floor, **fields: object) -> InflightRequest:
    entry = floor.request(**fields)  # type: ignore[arg-type]
    floor.ledger.admit(entry, None, floor.ledger.engine_for(floor.pool.everyone, None, None))
    return entry


def aborts(floor: Floor, engine_id: str) -> list[str]:
    return [
        sent.decode()["request_id"]
        for sent in floor.bus.on(floor.core.subjects.engine(engine_id, Header.ABORT_REQUEST))
    ]


async def test_a_lost_engines_requests_are_retried_elsewhere_or_migrate() -> None:
    floor = build(routing_policy="round_robin")
    job = fleet(floor)
    await job.register("e1", 4, None)
    plain = admitted(floor)
    streamed = admitted(floor, stream=True)
    streamed.streamed, streamed.streamed_tokens = True, [1, 2]
    await job.register("e2", 4, None)
    await job.remove("e1", "gone")
    assert plain.engine_id == "e2" and plain.attempt == 1 and floor.core.counters["retried"] == 1
    assert streamed.engine_id == "e2" and streamed.migrations == 1 and floor.core.counters["migrated"] == 1
    assert aborts(floor, "e1") == [streamed.return_path.request_id]  # should it still run, it stops
    assert floor.pool.get("e2").load == 2  # type: ignore[union-attr]


async def test_a_request_beyond_its_retries_fails_with_503() -> None:
    floor = build(max_retries=0)
    job = fleet(floor)
    await job.register("e1", 4, None)
    entry = admitted(floor)
    await job.remove("e1", "gone")
    [answer] = floor.bus.to(entry.return_path.reply_to)
    assert answer.json()["error"]["code"] == 503 and len(floor.ledger) == 0


async def test_a_stream_that_cannot_resume_fails_rather_than_run_again() -> None:
    floor = build()
    job = fleet(floor)
    await job.register("e1", 4, None)
    entry = admitted(floor, stream=True)
    entry.streamed, entry.resumable = True, False
    await job.remove("e1", "gone")
    answer, end = floor.bus.to(entry.return_path.reply_to)
    assert answer.json()["error"]["code"] == 503 and end.body == b"" and floor.core.counters["migrations_refused"] == 1


async def test_an_engines_heartbeat_introduces_it_and_the_queue_is_released() -> None:
    floor = build()
    job = fleet(floor)
    waiting = admitted(floor)
    assert waiting.engine_id is None
    await job.heartbeat(Heartbeat("e9", capacity=2))
    assert waiting.engine_id == "e9" and job.changed.is_set()


async def test_register_refuses_a_bad_id_and_a_full_pool() -> None:
    floor = build(max_engines=1)
    job = fleet(floor)
    with pytest.raises(WireError) as bad:
        await job.register("not a token", 4, None)
    await job.register("e1", 4, None)
    with pytest.raises(WireError) as full:
        await job.register("e2", 4, None)
    assert (bad.value.code, full.value.code) == (400, 429)


async def test_an_engine_may_speak_only_for_itself() -> None:
    floor = build()
    job = fleet(floor)
    await job.register("e1", 4, None)
    assert job.speaker("e1", "e1") == "e1"
    for sender in ("e2", None):  # another engine; the plain subject, for one on its own subjects
        with pytest.raises(WireError) as refusal:
            job.speaker(sender, "e1")
        assert refusal.value.code == 403


async def test_what_an_engine_never_received_is_routed_again(later: Later) -> None:
    floor = build()
    job = fleet(floor)
    await job.register("e1", 4, None)
    lost, held = admitted(floor), admitted(floor)
    lost_id = lost.return_path.request_id
    floor.bus.responders[floor.core.subjects.engine("e1", RESEND_REPLIES)] = lambda body: [
        encode_msgpack(ResendAnswer([lost_id]))
    ]
    later.advance(2 * floor.settings.heartbeat_interval_s + 1)  # routed a while ago
    await job.reconcile(floor.pool.get("e1"), {held.return_path.request_id})  # type: ignore[arg-type]
    assert lost.engine_id == "e1" and lost.attempt == 1 and floor.core.counters["redispatched"] == 1
    assert floor.pool.get("e1").load == 2  # type: ignore[union-attr]


async def test_the_watchdog_removes_a_silent_engine_and_suspects_a_stalled_one(later: Later) -> None:
    floor = build(heartbeat_timeout_s=0.2, heartbeat_interval_s=0.1, engine_progress_timeout_s=1.0)
    job = fleet(floor)
    await job.register("silent", 4, None)
    await job.register("stalled", 4, None)
    floor.pool.remove("silent", departed=False)  # route the request to the stalled one
    entry = admitted(floor)
    floor.pool.add("silent", 4)
    later.advance(2.0)
    healthy = floor.pool.add("healthy", 4)
    for heard in (healthy, floor.pool.get("stalled")):
        floor.pool.heard(heard)  # type: ignore[arg-type]
    await job.watch_once()
    assert floor.pool.get("silent") is None and floor.pool.get("stalled") is None
    assert floor.core.counters["engines_silent"] == 1
    assert floor.core.counters["engines_suspected"] == 1 and entry.engine_id == "healthy" and healthy.load == 1
    assert aborts(floor, "stalled") == [entry.return_path.request_id]  # a live engine answers it


async def test_engines_silent_together_leave_together_so_no_retry_goes_to_one_of_them(later: Later) -> None:
    """Issue 34, 4: three engines silent at once (as a replica sees them after its own stall).
    Removed one by one, a request spent its retries on the next engine about to go and ended
    with 503 "engine e3 lost"; now all leave first, and it runs again on the engine left."""
    floor = build(heartbeat_timeout_s=0.2, heartbeat_interval_s=0.1, routing_policy="round_robin")
    job = fleet(floor)
    for engine_id in ("e1", "e2", "e3", "e4"):
        await job.register(engine_id, 4, None)
    entry = admitted(floor)
    assert entry.engine_id == "e1"
    later.advance(2.0)
    floor.pool.heard(floor.pool.get("e4"))  # type: ignore[arg-type]
    await job.watch_once()
    await floor.spawned.settle()
    assert not floor.bus.to(entry.return_path.reply_to) and floor.core.counters["retried"] == 1
    assert entry.engine_id == "e4" and entry.attempt == 1 and [record.engine_id for record in floor.pool] == ["e4"]


async def test_a_watchdog_round_after_this_replicas_own_stall_removes_nothing(
    later: Later, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped (SIGSTOP) replica resumes to find every engine silent: the silence was its own,
    so the round is skipped and the engines get a full timeout to be heard again."""
    monkeypatch.setattr(stalls, "time", later)
    floor = build(heartbeat_timeout_s=0.2, heartbeat_interval_s=0.1)
    watch = Stalls(0.1, floor.core.counters)
    job = Fleet(floor.core, floor.ledger, floor.pool, floor.control, watch)
    watch.listen(job.forgive_silence)
    await job.register("e1", 4, None)
    entry = admitted(floor)
    round_ = asyncio.ensure_future(job.watch_once())
    await asyncio.sleep(0)  # the round begins its sleep
    later.advance(5.0)  # the process stops while the watchdog sleeps
    await round_
    assert floor.pool.get("e1") is not None and entry.engine_id == "e1" and floor.core.counters["stalls"] == 1
    await job.watch_once()  # the next round: heard again within the timeout, by forgiveness
    assert floor.pool.get("e1") is not None
