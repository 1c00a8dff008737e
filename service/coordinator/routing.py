"""Routing policies: which engine gets the next request, in O(1) whatever the fleet's size.

A policy reads the indexes of :class:`~service.coordinator.pool.EnginePool` and never scans
the engines. ``choose`` returns None when every engine is full, so the coordinator can hold
or refuse the request. The coordinator calls ``turn_ended`` when it publishes the requests
routed in one event-loop turn (one message per engine), so a policy knows which engine is
already receiving a batch.

- ``least_loaded`` (default): fewest requests in flight, equals in rotation. With a
  ``routing_load_slack`` of s, the engine already receiving a batch this turn keeps getting
  requests while its load is at most the least loaded engine's plus s: under load, routed
  messages keep carrying several requests however many engines there are, at the price of
  loads differing by up to s + 1. O(1).
- ``p2c``: power of two choices. Two engines drawn at random, the less loaded one wins (the
  same slack applies against it). O(1), with no shared order among coordinator replicas.
- ``round_robin``: each engine with room in turn, ignoring load. O(1).
- ``prefix``: see :mod:`service.coordinator.prefix_routing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from service.coordinator.pool import EnginePool, EngineRecord
from service.coordinator.prefix_routing import PrefixAware, PrefixTable
from service.ops.settings import Settings
from service.protocol.messages import SubmitEnvelope, SubmitRequest

PrefixHashes = Sequence[int]


class RoutingPolicy(Protocol):
    def key_of(self, submit: SubmitRequest | SubmitEnvelope) -> PrefixHashes | None:
        """What ``choose`` needs of a submission beyond the fleet's loads (prefix hashes), if anything."""
        ...

    def choose(self, key: PrefixHashes | None = None) -> EngineRecord | None: ...

    def turn_ended(self) -> None: ...


class _Batching:
    """The engine receiving a batch this loop turn, kept while it stays within the load slack."""

    def __init__(self, load_slack: int) -> None:
        self._slack = load_slack
        self._current: EngineRecord | None = None

    def key_of(self, submit: SubmitRequest | SubmitEnvelope) -> PrefixHashes | None:
        return None

    def turn_ended(self) -> None:
        self._current = None


class LeastLoaded(_Batching):
    def __init__(self, pool: EnginePool, load_slack: int = 0) -> None:
        super().__init__(load_slack)
        self._pool = pool

    def choose(self, key: PrefixHashes | None = None) -> EngineRecord | None:
        pool = self._pool
        least = pool.least_loaded()
        if least is None:
            return None
        current = self._current
        if current is not None and current is not least and current.slot >= 0:
            load = len(current.requests)
            if load < current.capacity and load <= pool.lowest_load + self._slack:
                return current
        self._current = least
        return least


class PowerOfTwoChoices(_Batching):
    def __init__(self, pool: EnginePool, load_slack: int = 0) -> None:
        super().__init__(load_slack)
        self._pool = pool

    def choose(self, key: PrefixHashes | None = None) -> EngineRecord | None:
        pool = self._pool
        if len(pool) == 0:
            return None
        first, second = pool.sample_two()
        best = first if len(first.requests) <= len(second.requests) else second
        if len(best.requests) >= best.capacity:
            with_room = pool.least_loaded()
            if with_room is None:
                return None
            best = with_room
        current = self._current
        if current is not None and current is not best and current.slot >= 0:
            load = len(current.requests)
            if load < current.capacity and load <= len(best.requests) + self._slack:
                return current
        self._current = best
        return best


class RoundRobin:
    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool

    def key_of(self, submit: SubmitRequest | SubmitEnvelope) -> PrefixHashes | None:
        return None

    def choose(self, key: PrefixHashes | None = None) -> EngineRecord | None:
        return self._pool.next_in_turn()

    def turn_ended(self) -> None:
        pass


def make_policy(settings: Settings, pool: EnginePool) -> RoutingPolicy:
    name = settings.routing_policy
    if name == "least_loaded":
        return LeastLoaded(pool, settings.routing_load_slack)
    if name == "p2c":
        return PowerOfTwoChoices(pool, settings.routing_load_slack)
    if name == "round_robin":
        return RoundRobin(pool)
    if name == "prefix":
        table = PrefixTable(settings.prefix_table_size, settings.prefix_ttl_s)
        return PrefixAware(LeastLoaded(pool, settings.routing_load_slack), pool, table, settings.prefix_load_bound)
    raise ValueError(f"unknown routing policy {name!r}")
