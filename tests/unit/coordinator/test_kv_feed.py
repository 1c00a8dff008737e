"""The KV feed on a recording bus: events applied in their numbering, a gap answered by a
snapshot, snapshots when an engine registers, when a heartbeat introduces it (a replica that
starts: it routes by the index only once it has learnt it), and when it is first heard; the
engines that publish none, and the bounds."""

from __future__ import annotations

from service.coordinator.fleet import Fleet
from service.coordinator.kv_feed import MAX_BUFFERED, KvFeed
from service.coordinator.route_key import RouteKey
from service.protocol.codec import encode_msgpack
from service.protocol.kv_events import HeldPrefix, KvEvents, KvSnapshot
from service.protocol.membership import Heartbeat
from service.protocol.prefix import TOKENS_PER_BLOCK, prefix_hashes
from service.protocol.subjects import KV_SNAPSHOT
from tests.unit.coordinator.wiring import Floor, build


class EngineDouble:
    """Test double of one engine's side of the feed: answers ``kv_snapshot`` on the recording
    bus with what the test says it holds, and counts the questions."""

    def __init__(self, floor: Floor, engine_id: str, held: dict[int, int] | None = None, sequence: int = 0) -> None:
        self.engine_id = engine_id
        self.held = held or {}
        self.sequence = sequence
        self.asked = 0
        self.subject = floor.core.subjects.engine(engine_id, KV_SNAPSHOT)
        floor.bus.responders[self.subject] = self._answer

    def _answer(self, payload: bytes) -> list[bytes]:
        self.asked += 1
        held = [HeldPrefix(prefix_hash, blocks) for prefix_hash, blocks in self.held.items()]
        return [encode_msgpack(KvSnapshot(self.engine_id, self.sequence, held, queued_tokens=0))]


def feed_of(clock: Clock | None = None, **settings: object) -> tuple[Floor, KvFeed]:
    floor = build(**{"routing_policy": "cache_aware", **settings})  # type: ignore[arg-type]
    return floor, KvFeed(floor.core, floor.blocks, floor.pool, floor.ledger.release, clock or Clock())


class Clock:
    """Test double of the feed's clock: time moves when the test says."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def heard_all(floor: Floor, feed: KvFeed, clock: Clock) -> None:
    """Ticks: one interval after the start (too early), then two more without a new engine."""
    for _ in range(3):
        feed.tick()
        assert floor.blocks.learning
        clock.now += floor.settings.heartbeat_interval_s
    feed.tick()


def holders(floor: Floor, prefix_hash: int) -> dict[str, int]:
    return {engine.engine_id: blocks for engine, blocks in floor.blocks.matches([prefix_hash], 0.0, 64).items()}


def stored(sequence: int, *pairs: tuple[int, int], queued_tokens: int = 0) -> KvEvents:
    return KvEvents("e1", sequence, [HeldPrefix(h, b) for h, b in pairs], queued_tokens=queued_tokens)


async def test_register_takes_a_snapshot_then_events_apply_in_order() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    engine = EngineDouble(floor, "e1", {1: 1})
    feed.registered("e1", kv_sequence=0)
    await floor.spawned.settle()
    assert engine.asked == 1 and holders(floor, 1) == {"e1": 1}
    feed.received("e1", stored(1, (2, 2), queued_tokens=96))
    record = floor.pool.get("e1")
    assert record is not None and record.queued_tokens == 96
    feed.received("e1", KvEvents("e1", 2, evicted=[1]))  # each event says how many wait now
    assert holders(floor, 1) == {} and holders(floor, 2) == {"e1": 2} and engine.asked == 1
    assert record.queued_tokens == 0


async def test_a_gap_asks_a_snapshot_and_the_events_meanwhile_apply_after_it() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    engine = EngineDouble(floor, "e1")
    feed.registered("e1", kv_sequence=0)
    await floor.spawned.settle()
    feed.received("e1", stored(1, (1, 1)))
    feed.received("e1", stored(3, (3, 1)))  # 2 was lost
    feed.received("e1", stored(4, (4, 1)))  # while the snapshot is asked: kept
    engine.held, engine.sequence = {2: 1}, 2  # what it holds after 1 and 2
    await floor.spawned.settle()
    assert engine.asked == 2 and floor.core.counters["kv_gaps"] == 1
    assert [holders(floor, h) for h in (1, 2, 3, 4)] == [{}, {"e1": 1}, {"e1": 1}, {"e1": 1}]
    assert floor.blocks.engines["e1"].sequence == 4


async def test_events_a_snapshot_already_covers_are_dropped() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    engine = EngineDouble(floor, "e1", {5: 1}, sequence=7)
    feed.received("e1", stored(7, (9, 1)))  # first heard publishing: tracked, and a snapshot asked
    await floor.spawned.settle()
    assert engine.asked == 1 and holders(floor, 9) == {} and holders(floor, 5) == {"e1": 1}
    feed.received("e1", stored(8, (6, 1)))
    assert holders(floor, 6) == {"e1": 1} and engine.asked == 1


async def test_a_heartbeat_introducing_an_engine_takes_a_snapshot_and_one_ahead_is_a_gap() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    engine = EngineDouble(floor, "e1", {1: 1}, sequence=5)
    feed.heard(Heartbeat("e1", kv_sequence=5))
    await floor.spawned.settle()
    assert engine.asked == 1 and holders(floor, 1) == {"e1": 1}
    feed.heard(Heartbeat("e1", kv_sequence=5))
    await floor.spawned.settle()
    assert engine.asked == 1  # in step
    feed.heard(Heartbeat("e1", kv_sequence=6))  # its last event was lost
    engine.held, engine.sequence = {2: 1}, 6
    await floor.spawned.settle()
    assert engine.asked == 2 and holders(floor, 2) == {"e1": 1} and floor.core.counters["kv_gaps"] == 1


async def test_a_replica_that_starts_rebuilds_its_index_from_snapshots_before_it_routes_by_it() -> None:
    """A fresh replica hears the fleet's heartbeats: each engine is adopted and snapshotted,
    with nothing replayed. A request with a key waits until every engine was heard and its
    snapshot is in; then the first sharing a held prefix goes to its holder."""
    clock = Clock()
    floor, feed = feed_of(clock)
    fleet = Fleet(floor.core, floor.ledger, floor.pool, floor.control)
    prompt = list(range(64 * TOKENS_PER_BLOCK))
    hashes = prefix_hashes(prompt)
    key = RouteKey(prefix_hashes(prompt + [7] * 16))
    doubles = [EngineDouble(floor, f"e{n}", {hashes[-1]: 64} if n == 2 else {}, sequence=40) for n in range(4)]
    for n in range(4):
        heartbeat = Heartbeat(f"e{n}", capacity=8, kv_sequence=40)
        await fleet.heartbeat(heartbeat)
        feed.heard(heartbeat)
        assert floor.ledger.engine_for(floor.pool.everyone, None, key) is None  # learning: it waits
    await floor.spawned.settle()
    assert [double.asked for double in doubles] == [1, 1, 1, 1] and len(floor.blocks.engines) == 4
    assert floor.blocks.learning  # every snapshot in, but the fleet may not all have been heard
    feed.tick()  # an engine new less than an interval ago: others may come
    clock.now += 2 * floor.settings.heartbeat_interval_s
    feed.tick()
    chosen = floor.ledger.engine_for(floor.pool.everyone, None, key)
    assert chosen is not None and chosen.engine_id == "e2"


async def test_requests_that_waited_while_learning_go_where_the_snapshots_say() -> None:
    clock = Clock()
    floor, feed = feed_of(clock)
    prompt = list(range(64 * TOKENS_PER_BLOCK))
    for n in range(3):
        floor.engine(f"e{n}")
        EngineDouble(floor, f"e{n}", {prefix_hashes(prompt)[-1]: 64} if n == 1 else {}, sequence=3)
    for n in range(3):
        feed.heard(Heartbeat(f"e{n}", kv_sequence=3))
    heard_all(floor, feed, clock)
    entries = [floor.request() for _ in range(3)]
    for entry in entries:
        entry.routing_key = RouteKey(prefix_hashes(prompt))
        floor.ledger.admit(entry, None, floor.ledger.engine_for(floor.pool.everyone, None, entry.routing_key))
    assert floor.ledger.queued == 3  # snapshots asked, not answered yet
    await floor.spawned.settle()  # answered: learning is over and the queue released
    assert not floor.blocks.learning and not floor.ledger.queued
    assert {entry.engine_id for entry in entries} == {"e1"}


async def test_learning_ends_with_warm_up_whatever_is_still_asked() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    feed.heard(Heartbeat("e1", kv_sequence=0))  # nobody answers: the snapshot fails later
    assert floor.blocks.learning
    feed.warmed_up()
    key = RouteKey(prefix_hashes(list(range(32))))
    assert not floor.blocks.learning and floor.ledger.engine_for(floor.pool.everyone, None, key) is not None
    floor, feed = feed_of(routing_policy="least_loaded")
    assert not floor.blocks.learning


async def test_a_snapshot_not_answered_leaves_the_number_unknown_and_the_next_event_asks_again() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    feed.registered("e1", kv_sequence=0)  # no responder: NATS says nobody answers
    await floor.spawned.settle()
    assert floor.core.counters["kv_snapshots_failed"] == 1 and floor.blocks.engines["e1"].sequence is None
    engine = EngineDouble(floor, "e1", {3: 2}, sequence=1)
    feed.received("e1", stored(1, (3, 2)))
    await floor.spawned.settle()
    assert engine.asked == 1 and holders(floor, 3) == {"e1": 2}


async def test_a_snapshot_answered_for_another_engine_is_refused() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    impostor = EngineDouble(floor, "e2", {1: 1})
    floor.bus.responders[floor.core.subjects.engine("e1", KV_SNAPSHOT)] = impostor._answer
    feed.registered("e1", kv_sequence=0)
    await floor.spawned.settle()
    assert floor.core.counters["kv_snapshots_failed"] == 1 and holders(floor, 1) == {}


async def test_too_many_events_while_asking_ask_again() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    engine = EngineDouble(floor, "e1")
    feed.registered("e1", kv_sequence=0)
    for sequence in range(1, MAX_BUFFERED + 3):
        feed.received("e1", stored(sequence, (sequence, 1)))
    await floor.spawned.settle()
    assert engine.asked == 2


async def test_engines_without_kv_events_and_other_policies_are_left_alone() -> None:
    floor, feed = feed_of()
    floor.engine("e1")
    engine = EngineDouble(floor, "e1")
    feed.registered("e1", kv_sequence=None)
    feed.heard(Heartbeat("e1"))
    await floor.spawned.settle()
    assert engine.asked == 0 and floor.blocks.engines == {}
    floor, feed = feed_of(routing_policy="least_loaded")
    floor.engine("e1")
    engine = EngineDouble(floor, "e1")
    feed.registered("e1", kv_sequence=0)
    feed.received("e1", stored(1, (1, 1)))
    await floor.spawned.settle()
    assert engine.asked == 0 and floor.blocks.engines == {}


async def test_engines_gone_from_the_pool_are_forgotten_and_a_new_registration_starts_afresh() -> None:
    floor, feed = feed_of()
    for engine_id in ("e1", "e2"):
        floor.engine(engine_id)
        EngineDouble(floor, engine_id, {1: 1})
        feed.registered(engine_id, kv_sequence=0)
    feed.received("e9", stored(1, (1, 1)))  # not in the pool: ignored
    await floor.spawned.settle()
    floor.pool.remove("e1", departed=True)
    floor.pool.remove("e2", departed=True)
    floor.engine("e2")  # registered again: a new record, an empty cache
    feed.sweep()
    assert floor.blocks.engines == {} and holders(floor, 1) == {}
