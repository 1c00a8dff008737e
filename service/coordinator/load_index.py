"""Engines with room, bucketed by load, so routing never scans the fleet.

Bucket ``n`` holds the engines with ``n`` requests in flight and room for one more, in the
order they entered it. The least loaded engine is the oldest member of the lowest non-empty
bucket, so among equally loaded engines the one that waited longest goes first: ties rotate.
An engine at its capacity is in no bucket.

Every operation is O(1) in the number of engines. Finding the lowest non-empty bucket walks
up from a lower bound on it, so one call may step over empty buckets, but never over more
than the per-engine capacity (``max_inflight_per_engine``), whatever the fleet's size.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class LoadIndex(Generic[T]):
    def __init__(self) -> None:
        self._buckets: list[OrderedDict[T, None]] = []
        self._lowest = 0  # no bucket below this one holds an engine

    def add(self, item: T, load: int) -> None:
        buckets = self._buckets
        while len(buckets) <= load:
            buckets.append(OrderedDict())
        buckets[load][item] = None
        self._lowest = min(self._lowest, load)

    def discard(self, item: T, load: int) -> None:
        if load < len(self._buckets):
            self._buckets[load].pop(item, None)

    def least_loaded(self) -> T | None:
        """The engine with the fewest requests in flight that has room; None when all are full."""
        buckets = self._buckets
        lowest = self._lowest
        while lowest < len(buckets):
            bucket = buckets[lowest]
            if bucket:
                self._lowest = lowest
                return next(iter(bucket))
            lowest += 1
        self._lowest = lowest
        return None

    @property
    def lowest_load(self) -> int:
        """The load of :meth:`least_loaded`'s engine (meaningful when it returned one)."""
        return self._lowest
