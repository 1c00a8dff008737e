"""Homes: the engine a session (or a group of submissions) was last routed to, so its next
request goes there too (``cache_aware`` routing, docs/protocol.md, *Sessions and groups*).

Bounded in count (the least recently used forgotten first) and in age (a home unused for
``ttl_s`` is forgotten: at once for lookups, its memory when the table next trims). A home is a
pool record: an engine that left, or registered again (a new record, an empty cache), is no
home any more, which :mod:`.cache_routing` checks.
"""

from __future__ import annotations

from collections import OrderedDict

from service.coordinator.pool import EngineRecord


class Homes:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[EngineRecord, float]] = OrderedDict()  # least recently used first

    def get(self, key: str, now: float) -> EngineRecord | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now - entry[1] > self._ttl_s:
            del self._entries[key]
            return None
        return entry[0]

    def set(self, key: str, record: EngineRecord, now: float) -> None:
        """``key``'s home is ``record`` from now on (refreshed when it was already)."""
        entries = self._entries
        entries[key] = (record, now)
        entries.move_to_end(key)
        ttl_s = self._ttl_s
        while entries:
            oldest, (_, used_at) = next(iter(entries.items()))
            if len(entries) <= self._max_entries and now - used_at <= ttl_s:
                return
            del entries[oldest]

    def __len__(self) -> int:
        return len(self._entries)
