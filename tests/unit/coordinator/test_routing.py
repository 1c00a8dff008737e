from __future__ import annotations

from collections import Counter

import pytest

from service.coordinator.pool import EngineRecord
from service.coordinator.routing import LeastLoaded, RoundRobin, make_policy


def engines(*loads: int, capacity: int = 4) -> list[EngineRecord]:
    return [EngineRecord(f"e{i}", capacity, requests={f"r{i}-{j}" for j in range(load)}) for i, load in enumerate(loads)]


def test_least_loaded_picks_the_emptiest() -> None:
    assert LeastLoaded().choose(engines(3, 1, 2)).engine_id == "e1"  # type: ignore[union-attr]


def test_least_loaded_rotates_ties() -> None:
    policy, pool = LeastLoaded(), engines(0, 0, 0)
    picks = Counter(policy.choose(pool).engine_id for _ in range(30))  # type: ignore[union-attr]
    assert picks == {"e0": 10, "e1": 10, "e2": 10}


def test_full_engines_are_skipped_and_none_when_all_full() -> None:
    assert LeastLoaded().choose(engines(4, 4, 3)).engine_id == "e2"  # type: ignore[union-attr]
    assert LeastLoaded().choose(engines(4, 4)) is None
    assert RoundRobin().choose(engines(4, 4)) is None
    assert LeastLoaded().choose([]) is None


def test_round_robin_cycles_and_skips_full() -> None:
    policy, pool = RoundRobin(), engines(0, 4, 0)
    assert [policy.choose(pool).engine_id for _ in range(4)] == ["e0", "e2", "e0", "e2"]  # type: ignore[union-attr]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="least_loaded"):
        make_policy("fastest")
