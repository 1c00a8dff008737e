"""The block index alone: what engines said they hold, routing's predictions beside it, the
longest held prefix per engine, and every bound."""

from __future__ import annotations

from service.coordinator.block_index import BlockIndex, EngineBlocks
from service.coordinator.pool import EnginePool
from service.protocol.kv_events import HeldPrefix

NOW = 100.0


def index_of(*engine_ids: str, max_entries: int = 1000, ttl_s: float = 2.0) -> tuple[BlockIndex, list[EngineBlocks]]:
    pool = EnginePool(max_inflight_per_engine=64, departed_memory_s=10.0)
    index = BlockIndex(max_entries, ttl_s)
    return index, [index.track(engine_id, pool.add(engine_id, 8)) for engine_id in engine_ids]


def held(*pairs: tuple[int, int]) -> list[HeldPrefix]:
    return [HeldPrefix(prefix_hash, blocks) for prefix_hash, blocks in pairs]


def matched(index: BlockIndex, hashes: list[int], limit: int = 8, now: float = NOW) -> dict[str, int]:
    return {engine.engine_id: blocks for engine, blocks in index.matches(hashes, now, limit).items()}


def test_each_engine_is_matched_at_the_longest_prefix_it_holds() -> None:
    index, (a, b) = index_of("a", "b")
    index.store(a, held((1, 1), (2, 2), (3, 4)))
    index.store(b, held((1, 1), (2, 2)))
    assert matched(index, [1, 2, 3, 4]) == {"a": 4, "b": 2}
    assert matched(index, [9, 2]) == {"a": 2, "b": 2}  # a hash names its whole prefix: no need to hold the shorter
    assert matched(index, [7, 8]) == {}
    assert index.held_blocks(a, [1, 2, 3], NOW) == 4 and index.held_blocks(b, [1, 2, 3], NOW) == 2


def test_evicted_prefixes_are_no_longer_held_and_empty_entries_go() -> None:
    index, (a, b) = index_of("a", "b")
    index.store(a, held((1, 1), (2, 2)))
    index.store(b, held((1, 1)))
    index.evict(a, [2, 1, 99])  # one it never held is ignored
    assert matched(index, [1, 2]) == {"b": 1} and index.entries == 1
    index.evict(b, [1])
    assert len(index) == 0 and index.entries == 0


def test_a_snapshot_replaces_what_the_engine_held() -> None:
    index, (a,) = index_of("a")
    index.store(a, held((1, 1), (2, 2)))
    index.replace(a, held((5, 1)))
    assert matched(index, [1, 2]) == {} and matched(index, [5]) == {"a": 1} and index.entries == 1


def test_a_forgotten_engine_leaves_nothing_behind() -> None:
    index, (a, b) = index_of("a", "b")
    index.store(a, held((1, 1), (2, 2)))
    index.store(b, held((2, 2)))
    index.forget("a")
    assert matched(index, [1, 2]) == {"b": 2} and index.entries == 1 and "a" not in index.engines
    again = index.track("b", b.record)  # tracked anew: the old entry's prefixes are gone
    assert again is not b and matched(index, [1, 2]) == {} and index.entries == 0


def test_holders_read_per_hash_are_bounded_most_recent_first() -> None:
    engine_ids = [f"e{n}" for n in range(20)]
    index, engines = index_of(*engine_ids)
    for engine in engines:
        index.store(engine, held((7, 3)))
    assert list(matched(index, [7], limit=4)) == ["e19", "e18", "e17", "e16"]


def test_the_index_is_shared_evenly_and_each_engine_forgets_its_oldest() -> None:
    index, (a, b) = index_of("a", "b", max_entries=4)
    index.store(a, held(*[(n, 1) for n in range(1, 6)]))
    assert list(a.held) == [4, 5] and index.entries == 2  # its share is 4 // 2
    index.store(a, held((4, 1), (6, 1)))  # storing again refreshes: 5 is now the oldest
    assert list(a.held) == [4, 6] and matched(index, [5]) == {}
    index.store(b, held((1, 1), (2, 1), (3, 1)))
    assert list(b.held) == [2, 3] and index.entries == 4


def test_a_prediction_counts_as_held_until_its_ttl() -> None:
    index, (a,) = index_of("a", ttl_s=2.0)
    index.predict(a, [1, 2, 3], NOW)
    assert matched(index, [1, 2, 3], now=NOW + 1) == {"a": 3}  # three hashes: the last one past 2 blocks
    assert matched(index, [1, 2, 3], now=NOW + 2.5) == {}
    index.predict(a, [9], NOW + 3)  # predicting sweeps what expired
    assert len(index) == 1 and index.predictions == 1


def test_a_prediction_never_shadows_what_the_engine_said() -> None:
    index, (a,) = index_of("a", ttl_s=2.0)
    index.store(a, held((1, 1)))
    index.predict(a, [1, 2], NOW)
    assert matched(index, [1, 2], now=NOW + 10) == {"a": 1}  # 2 expired, 1 is held
    index.store(a, held((2, 2)))  # the engine confirms the prediction: held for good
    index.predict(a, [3], NOW + 20)
    assert matched(index, [1, 2], now=NOW + 20) == {"a": 2}
    index.evict(a, [2])
    assert matched(index, [1, 2], now=NOW + 20) == {"a": 1}


def test_predictions_are_bounded() -> None:
    index, (a,) = index_of("a", max_entries=3, ttl_s=100.0)
    index.predict(a, [1, 2, 3, 4, 5], NOW)  # longest first: the two longest are the oldest, and go
    assert index.predictions == 3 and matched(index, [4, 5]) == {} and matched(index, [3]) == {"a": 4}
