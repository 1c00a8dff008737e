"""Terminal replies of named clients, kept for a while so a resubmission (after a reconnect,
say) gets the answer again instead of running the request twice."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from service.request_table import ClientKey


@dataclass(frozen=True, slots=True)
class CachedResult:
    body: bytes
    stored_at: float


class ResultCache:
    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._results: OrderedDict[ClientKey, CachedResult] = OrderedDict()

    def put(self, key: ClientKey, body: bytes) -> None:
        if self._max_entries == 0:
            return
        now = time.monotonic()
        self._results[key] = CachedResult(body, now)
        self._results.move_to_end(key)
        self._expire(now)
        while len(self._results) > self._max_entries:
            self._results.popitem(last=False)

    def get(self, key: ClientKey) -> CachedResult | None:
        self._expire(time.monotonic())
        return self._results.get(key)

    def _expire(self, now: float) -> None:
        results = self._results
        while results:
            key, oldest = next(iter(results.items()))
            if now - oldest.stored_at < self._ttl_s:
                return
            del results[key]

    def __len__(self) -> int:
        return len(self._results)
