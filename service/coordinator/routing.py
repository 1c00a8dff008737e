"""Routing policies: which engine gets the next request, in O(1) whatever the fleet's size.

A policy chooses within an :class:`~service.coordinator.pool.EngineGroup` (the whole fleet, or
the engines serving the model a request names), reading its indexes, never scanning its
engines. ``choose`` returns None when every engine of the group is full, so the coordinator
can hold or refuse the request. The coordinator calls ``turn_ended`` when it publishes the requests
routed in one event-loop turn (one message per engine), so a policy knows which engine is
already receiving a batch.

- ``least_loaded``: fewest requests in flight, equals in rotation. With a
  ``routing_load_slack`` of s, the engine already receiving a batch this turn keeps getting
  requests while its load is at most the least loaded engine's plus s: under load, routed
  messages keep carrying several requests however many engines there are, at the price of
  loads differing by up to s + 1. O(1).
- ``p2c``: power of two choices. Two engines drawn at random, the less loaded one wins (the
  same slack applies against it). O(1), with no shared order among coordinator replicas.
- ``round_robin``: each engine with room in turn, ignoring load. O(1).
- ``prefix``: see :mod:`service.coordinator.prefix_routing`.
- ``cache_aware`` (default): see :mod:`service.coordinator.cache_routing`.
"""

from __future__ import annotations

from typing import Protocol

from service.coordinator.block_index import BlockIndex
from service.coordinator.cache_routing import CacheAware
from service.coordinator.pool import EngineGroup, EngineRecord
from service.coordinator.prefix_routing import PrefixAware, PrefixTable
from service.coordinator.route_key import RouteKey
from service.ops.settings import Settings
from service.protocol.messages import SubmitEnvelope, SubmitRequest


class RoutingPolicy(Protocol):
    def key_of(self, submit: SubmitRequest | SubmitEnvelope) -> RouteKey | None:
        """What ``choose`` needs of a submission beyond the fleet's loads (prefix hashes, session,
        group), if anything."""
        ...

    def choose(self, group: EngineGroup, key: RouteKey | None = None) -> EngineRecord | None:
        """An engine of ``group`` (the whole fleet, or one model's engines) with room, or None."""
        ...

    def turn_ended(self) -> None: ...


class _Batching:
    """The engine receiving a batch this loop turn, kept while it stays within the load slack."""

    def __init__(self, load_slack: int = 0) -> None:
        self._slack = load_slack
        self._current: EngineRecord | None = None
        self._current_group: EngineGroup | None = None

    def key_of(self, submit: SubmitRequest | SubmitEnvelope) -> RouteKey | None:
        return None

    def _keep(self, group: EngineGroup, chosen: EngineRecord, lowest_load: int) -> EngineRecord:
        """The engine to route to: the one batching this turn while it qualifies, else ``chosen``."""
        current = self._current
        if current is not None and current is not chosen and group is self._current_group and current.in_pool:
            load = len(current.requests)
            if load < current.capacity and load <= lowest_load + self._slack:
                return current
        self._current, self._current_group = chosen, group
        return chosen

    def turn_ended(self) -> None:
        self._current = self._current_group = None


class LeastLoaded(_Batching):
    def choose(self, group: EngineGroup, key: RouteKey | None = None) -> EngineRecord | None:
        least = group.least_loaded()
        if least is None:
            return None
        return self._keep(group, least, group.lowest_load)


class PowerOfTwoChoices(_Batching):
    def choose(self, group: EngineGroup, key: RouteKey | None = None) -> EngineRecord | None:
        if len(group) == 0:
            return None
        first, second = group.sample_two()
        best = first if len(first.requests) <= len(second.requests) else second
        if len(best.requests) >= best.capacity:
            with_room = group.least_loaded()
            if with_room is None:
                return None
            best = with_room
        return self._keep(group, best, len(best.requests))


class RoundRobin:
    def key_of(self, submit: SubmitRequest | SubmitEnvelope) -> RouteKey | None:
        return None

    def choose(self, group: EngineGroup, key: RouteKey | None = None) -> EngineRecord | None:
        return group.next_in_turn()

    def turn_ended(self) -> None:
        pass


def make_policy(settings: Settings, index: BlockIndex | None = None) -> RoutingPolicy:
    """The policy ``settings`` names; ``cache_aware`` reads ``index`` (which the engines' KV
    events fill, :mod:`service.coordinator.kv_feed`), an empty one when None."""
    name = settings.routing_policy
    if name == "least_loaded":
        return LeastLoaded(settings.routing_load_slack)
    if name == "p2c":
        return PowerOfTwoChoices(settings.routing_load_slack)
    if name == "round_robin":
        return RoundRobin()
    if name == "prefix":
        table = PrefixTable(settings.prefix_table_size, settings.prefix_ttl_s)
        return PrefixAware(LeastLoaded(settings.routing_load_slack), table, settings.prefix_load_bound)
    if name == "cache_aware":
        if index is None:
            index = BlockIndex(settings.kv_index_size, settings.cache_aware_prediction_ttl_s)
        return CacheAware(LeastLoaded(settings.routing_load_slack), index, settings)
    raise ValueError(f"unknown routing policy {name!r}")
