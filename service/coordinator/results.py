"""Terminal replies of named clients, kept for a while so a resubmission (after a reconnect,
say) gets the answer again instead of running the request twice.

Each result remembers its owner (the inbox prefix its replies went to) and, for requests this
replica admitted, a digest of the body it was submitted with: a resubmission must match both
(see admission). The digest is XXH3-128, a fast non-cryptographic hash: it guards a client
against reusing an id with another prompt, and only the owner can resubmit, so a collision
could fool no one but its own sender. Keeping the digest instead of the body costs about 2 µs
for a 40 KB prompt, and keeping the body itself cost more (about 25 µs per request in
allocator work, measured with a 10,000-token prompt) and the cache's bytes.

The cache is bounded by count and by bytes (reply bodies, plus an allowance for the key and
owner, which admission caps at ``max_id_bytes`` each), oldest dropped first, and expired
entries are swept by time (:meth:`ResultCache.sweep`, which the coordinator calls every
heartbeat), not only when new results arrive.

Every completed request of a named client passes through here, so both calls are kept cheap:
``get`` checks only the entry it finds, and ``put`` sweeps expired entries (oldest first, as
they were stored in time order) at most every ``ttl_s / 16``. Entries are msgspec Structs of
atoms kept out of the garbage collector (``gc=False``), so a full cache adds nothing to its
sweeps.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import xxhash
from msgspec import Struct

from service.coordinator.requests import ClientKey

SWEEPS_PER_TTL = 16
# Bytes an entry costs besides its reply body and ids: the struct, the dict slot, the digest.
ENTRY_OVERHEAD = 200


class CachedResult(Struct, frozen=True, gc=False):
    body: bytes
    stored_at: float
    owner: str
    request_digest: bytes | None  # None for a result this replica delivered for a peer (an orphan)


# The digest a cached result keeps of the body it was submitted with (the C function itself:
# every completed request of a named client calls it).
body_digest: Callable[[bytes], bytes] = xxhash.xxh3_128_digest


class ResultCache:
    def __init__(self, ttl_s: float, max_entries: int, max_bytes: int, max_id_bytes: int = 256) -> None:
        self._ttl_s = ttl_s
        # What an entry costs besides its reply: its key and owner (each at most max_id_bytes), the rest.
        self._entry_bytes = 3 * max_id_bytes + ENTRY_OVERHEAD
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._results: OrderedDict[ClientKey, CachedResult] = OrderedDict()
        self._next_sweep = 0.0
        self.bytes = 0

    def put(self, key: ClientKey, body: bytes, owner: str, request_body: bytes | None) -> None:
        """Keep ``body``, the terminal reply, for ``owner``; ``request_body`` (None: an orphan's, unknown) is digested."""
        if self._max_entries == 0:
            return
        now = time.monotonic()
        results = self._results
        previous = results.pop(key, None)  # stored again: it moves to the young end (or goes, if too big)
        if previous is not None:
            self.bytes -= self._size(previous)
        cached = CachedResult(body, now, owner, None if request_body is None else body_digest(request_body))
        size = self._size(cached)
        if size > self._max_bytes:
            return
        results[key] = cached
        self.bytes += size
        if now >= self._next_sweep:
            self.sweep(now)
        while len(results) > self._max_entries or self.bytes > self._max_bytes:
            self.bytes -= self._size(results.popitem(last=False)[1])

    def _size(self, cached: CachedResult) -> int:
        return len(cached.body) + self._entry_bytes

    def get(self, key: ClientKey) -> CachedResult | None:
        cached = self._results.get(key)
        if cached is None or time.monotonic() - cached.stored_at >= self._ttl_s:
            return None
        return cached

    def sweep(self, now: float | None = None) -> None:
        """Drop expired entries, oldest first."""
        now = time.monotonic() if now is None else now
        self._next_sweep = now + self._ttl_s / SWEEPS_PER_TTL
        results = self._results
        while results:
            key, oldest = next(iter(results.items()))
            if now - oldest.stored_at < self._ttl_s:
                return
            del results[key]
            self.bytes -= self._size(oldest)

    def keys(self) -> list[ClientKey]:
        """The ids of the results held, expired ones not yet swept included."""
        return list(self._results)

    def __len__(self) -> int:
        """Entries held, including expired ones not yet swept (``get`` never returns those)."""
        return len(self._results)
