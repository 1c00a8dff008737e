"""Prefix-aware routing (``routing_policy: prefix``): a prompt goes where a prompt with the same
beginning went before, so the engine's prefix cache (the KV pages of a shared system prompt,
say) serves it.

A submission's prefix hashes (:mod:`service.protocol.prefix`) are chained hashes of the
prompt's first 1, 2, 4, ... blocks and of all its whole blocks, shortest first. The client
library sends them in its envelope, so the coordinator never decodes a prompt for them; for
a plain submission, which it decodes anyway, it computes them.

The table maps a hash to the engines most recently given a prompt with that prefix. A request
goes to the least loaded owner of its longest known prefix, provided that owner's load is at
most the least loaded engine's plus ``prefix_load_bound``: one hot prefix cannot pile onto one
engine. Past the bound, and for prompts with no known prefix or no hashes, the request goes
to the least-loaded engine (with the batching slack of
:class:`~service.coordinator.routing.LeastLoaded`), which becomes an owner of the prefix.

Everything is bounded: a request's hashes are at most ``MAX_PREFIX_HASHES`` (the wire type
says so), each hash has at most ``OWNERS_PER_PREFIX`` owners, so one choice reads a bounded
candidate set whatever the fleet; the table holds at most ``prefix_table_size`` hashes (least
recently used evicted first) and forgets a hash unused for ``prefix_ttl_s`` (at once for
lookups; its memory within ``SWEEP_EVERY`` choices). An owner that
left the pool is never chosen, and dropped when its entry next changes. A choice refreshes the
matched prefix and records the longer ones; the shorter ones age as they were.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from service.coordinator.pool import EngineGroup, EngineRecord
from service.coordinator.route_key import RouteKey, hashes_of
from service.protocol.messages import SubmitEnvelope, SubmitRequest

# Engines remembered per prefix: a hot prefix spreads over this many before the oldest is forgotten.
OWNERS_PER_PREFIX = 4
# Choices between two sweeps of the hashes unused for the TTL (the table is also trimmed to its
# size at every choice): the sweep's cost is spread over this many choices.
SWEEP_EVERY = 64


class Fallback(Protocol):
    def choose(self, group: EngineGroup, key: RouteKey | None = None) -> EngineRecord | None: ...

    def turn_ended(self) -> None: ...


@dataclass(slots=True)
class _Entry:
    owners: list[EngineRecord]  # most recent last
    used_at: float


class PrefixTable:
    """Prefix hash -> the engines most recently given it; bounded in count and age."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._until_sweep = SWEEP_EVERY

    def owners(self, prefix_hash: int, now: float) -> list[EngineRecord]:
        """Engines given this prefix within the TTL, most recent last (some may have left the
        pool since); empty when none."""
        entry = self._entries.get(prefix_hash)
        if entry is None:
            return []
        if now - entry.used_at > self._ttl_s:
            del self._entries[prefix_hash]
            return []
        return entry.owners

    def record(self, hashes: Sequence[int], engine: EngineRecord, now: float) -> None:
        """``engine`` was given a prompt with every prefix in ``hashes``."""
        entries = self._entries
        for prefix_hash in hashes:
            entry = entries.get(prefix_hash)
            if entry is None:
                entries[prefix_hash] = _Entry([engine], now)
                continue
            entry.used_at = now
            entries.move_to_end(prefix_hash)
            owners = entry.owners
            if owners[-1] is not engine:
                kept = [owner for owner in owners if owner is not engine and owner.in_pool]
                del kept[: max(0, len(kept) + 1 - OWNERS_PER_PREFIX)]
                owners[:] = [*kept, engine]
        self._until_sweep -= 1
        if self._until_sweep <= 0 or len(entries) > self._max_entries:
            self._until_sweep = SWEEP_EVERY
            self._evict(now)

    def _evict(self, now: float) -> None:
        """Least recently used first, while over the size or unused for the TTL."""
        entries = self._entries
        while entries:
            oldest, entry = next(iter(entries.items()))
            if len(entries) <= self._max_entries and now - entry.used_at <= self._ttl_s:
                return
            del entries[oldest]

    def __len__(self) -> int:
        return len(self._entries)


class PrefixAware:
    def __init__(self, fallback: Fallback, table: PrefixTable, load_bound: int) -> None:
        self._fallback = fallback
        self._table = table
        self._load_bound = load_bound

    def key_of(self, submit: SubmitRequest | SubmitEnvelope) -> RouteKey | None:
        hashes = hashes_of(submit)
        return RouteKey(hashes) if hashes else None

    def choose(self, group: EngineGroup, key: RouteKey | None = None) -> EngineRecord | None:
        if key is None or not key.hashes:
            return self._fallback.choose(group)
        hashes = key.hashes
        if group.least_loaded() is None:
            return None
        bound = group.lowest_load + self._load_bound
        now = time.monotonic()
        table = self._table
        for index in range(len(hashes) - 1, -1, -1):  # the longest known prefix first
            owners = table.owners(hashes[index], now)
            if owners:
                chosen = _least_loaded_within(owners, bound, group)
                if chosen is not None:
                    # Shorter prefixes were recorded with this one; the longer ones are new here.
                    table.record(hashes[index:], chosen, now)
                    return chosen
        chosen = self._fallback.choose(group)
        if chosen is not None:
            table.record(hashes, chosen, now)
        return chosen

    def turn_ended(self) -> None:
        self._fallback.turn_ended()


def _least_loaded_within(owners: list[EngineRecord], bound: int, group: EngineGroup) -> EngineRecord | None:
    best = None
    best_load = bound + 1
    for owner in reversed(owners):  # most recent first among equals
        load = len(owner.requests)
        if load < best_load and load < owner.capacity and owner.in_pool and owner in group:
            best, best_load = owner, load
    return best
