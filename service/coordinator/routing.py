"""Routing policies: which engine gets the next request.

A policy is a small object with ``choose(engines)``; it returns None when every engine is
full, so the coordinator can queue or refuse the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from service.coordinator.pool import EngineRecord


class RoutingPolicy(Protocol):
    def choose(self, engines: Sequence[EngineRecord]) -> EngineRecord | None: ...


class LeastLoaded:
    """Fewest requests in flight; among equals, the scan starts one engine later each time,
    so ties rotate instead of always landing on the first engine."""

    def __init__(self) -> None:
        self._offset = 0

    def choose(self, engines: Sequence[EngineRecord]) -> EngineRecord | None:
        count = len(engines)
        if count <= 1:  # nothing to compare: the common single-engine case stays cheap
            return engines[0] if count and len(engines[0].requests) < engines[0].capacity else None
        self._offset = (self._offset + 1) % count
        best: EngineRecord | None = None
        best_load = 0
        for i in range(count):
            record = engines[(self._offset + i) % count]
            load = len(record.requests)
            if load < record.capacity and (best is None or load < best_load):
                best, best_load = record, load
        return best


class RoundRobin:
    """Each engine in turn, skipping full ones."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, engines: Sequence[EngineRecord]) -> EngineRecord | None:
        count = len(engines)
        for i in range(count):
            record = engines[(self._next + i) % count]
            if record.has_room:
                self._next = (self._next + i + 1) % count
                return record
        return None


POLICIES: dict[str, type[LeastLoaded] | type[RoundRobin]] = {"least_loaded": LeastLoaded, "round_robin": RoundRobin}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
