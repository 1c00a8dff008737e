"""Terminal replies of named clients, kept for a while so a resubmission (after a reconnect,
say) gets the answer again instead of running the request twice.

Every completed request of a named client passes through here, so both calls are kept
cheap: ``get`` checks only the entry it finds, and ``put`` sweeps expired entries (oldest
first, as they were stored in time order) at most every ``ttl_s / 16``. Entries are plain
tuples of atoms, which the garbage collector stops tracking, so a full cache adds nothing
to its sweeps.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

from service.coordinator.requests import ClientKey

SWEEPS_PER_TTL = 16


class CachedResult(NamedTuple):
    body: bytes
    stored_at: float


class ResultCache:
    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._results: OrderedDict[ClientKey, CachedResult] = OrderedDict()
        self._next_sweep = 0.0

    def put(self, key: ClientKey, body: bytes) -> None:
        if self._max_entries == 0:
            return
        now = time.monotonic()
        results = self._results
        if key in results:
            del results[key]  # stored again: it moves to the young end
        results[key] = CachedResult(body, now)
        if now >= self._next_sweep:
            self._expire(now)
            self._next_sweep = now + self._ttl_s / SWEEPS_PER_TTL
        if len(results) > self._max_entries:
            results.popitem(last=False)

    def get(self, key: ClientKey) -> CachedResult | None:
        cached = self._results.get(key)
        if cached is None or time.monotonic() - cached.stored_at >= self._ttl_s:
            return None
        return cached

    def _expire(self, now: float) -> None:
        results = self._results
        while results:
            key, oldest = next(iter(results.items()))
            if now - oldest.stored_at < self._ttl_s:
                return
            del results[key]

    def __len__(self) -> int:
        """Entries held, including expired ones not yet swept (``get`` never returns those)."""
        return len(self._results)
