"""The coordinator's view of live engines: capacity, in-flight requests, last heartbeat.

Every change is O(1) in the number of engines, so a fleet of thousands costs what a few do:
registering, leaving, a heartbeat, a request routed (:meth:`EnginePool.assign`) or answered
(:meth:`EnginePool.release`), and finding engines that fell silent (which reads only those).
Loads change through the pool alone, because it keeps three indexes over them:

- engines with room bucketed by load, for least-loaded routing: bucket ``n`` holds the
  engines with ``n`` requests in flight, in the order they entered it, so the least loaded
  engine is the oldest member of the lowest non-empty bucket and equals take turns. Finding
  that bucket walks up from a lower bound on it, over at most ``max_inflight_per_engine``
  empty buckets, whatever the fleet's size;
- engines with room in turn, for round robin;
- a list to sample from uniformly, for the power of two choices.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class EngineRecord:
    engine_id: str
    capacity: int
    last_seen: float = field(default_factory=time.monotonic)
    requests: set[str] = field(default_factory=set)
    reconciling: bool = False
    slot: int = -1  # its index in the pool's list while in the pool, -1 once removed

    @property
    def load(self) -> int:
        return len(self.requests)

    @property
    def has_room(self) -> bool:
        return len(self.requests) < self.capacity

    @property
    def in_pool(self) -> bool:
        return self.slot >= 0


class EnginePool:
    """Live engines, plus recently departed ones: a heartbeat sent just before an engine left
    must not bring it back (only registering again does)."""

    def __init__(self, max_inflight_per_engine: int, departed_memory_s: float) -> None:
        self._max_inflight = max_inflight_per_engine
        self._departed_memory_s = departed_memory_s
        self._engines: dict[str, EngineRecord] = {}
        self._slots: list[EngineRecord] = []
        self._by_silence: OrderedDict[str, EngineRecord] = OrderedDict()  # least recently heard first
        self._departed: OrderedDict[str, float] = OrderedDict()  # engine id -> when it left, oldest first
        self._by_load: list[OrderedDict[EngineRecord, None]] = [OrderedDict()]  # engines with room, by load
        self.lowest_load = 0  # no engine with room has less load; exact after least_loaded() found one
        self._in_turn: OrderedDict[EngineRecord, None] = OrderedDict()  # engines with room, next in turn first

    # ------------------------------------------------------------ membership

    def add(self, engine_id: str, capacity: int) -> EngineRecord:
        """Adds a fresh record with zero load; an existing one must be removed first."""
        record = EngineRecord(engine_id, min(capacity, self._max_inflight), slot=len(self._slots))
        self._engines[engine_id] = record
        self._slots.append(record)
        self._by_silence[engine_id] = record
        self._departed.pop(engine_id, None)
        self._by_load[0][record] = None
        self.lowest_load = 0
        self._in_turn[record] = None
        return record

    def remove(self, engine_id: str, departed: bool) -> EngineRecord | None:
        """``departed``: the engine left on purpose, so its stray heartbeats must not re-add it.
        An engine removed for silence is taken back by its next heartbeat."""
        record = self._engines.pop(engine_id, None)
        if record is None:
            return None
        last = self._slots.pop()
        if last is not record:
            self._slots[record.slot] = last
            last.slot = record.slot
        record.slot = -1
        del self._by_silence[engine_id]
        if record.has_room:
            del self._by_load[len(record.requests)][record]
            del self._in_turn[record]
        if departed:
            now = time.monotonic()
            self._forget_departed(now)
            self._departed[engine_id] = now
        return record

    def _forget_departed(self, now: float) -> None:
        departed = self._departed
        while departed:
            engine_id, left_at = next(iter(departed.items()))
            if now - left_at < self._departed_memory_s:
                return
            del departed[engine_id]

    def recently_departed(self, engine_id: str) -> bool:
        departed_at = self._departed.get(engine_id)
        return departed_at is not None and time.monotonic() - departed_at < self._departed_memory_s

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[EngineRecord]:
        return iter(self._slots)

    # ------------------------------------------------------------ load

    def assign(self, record: EngineRecord, request_id: str) -> None:
        """``request_id`` is now in flight on ``record``."""
        requests = record.requests
        if request_id in requests:
            return
        load = len(requests)
        requests.add(request_id)
        if record.slot < 0:
            return
        by_load = self._by_load
        del by_load[load][record]
        load += 1
        if load < record.capacity:
            if load == len(by_load):
                by_load.append(OrderedDict())
            by_load[load][record] = None
        else:
            del self._in_turn[record]

    def release(self, engine_id: str, request_id: str) -> bool:
        """``request_id`` no longer occupies a slot of engine ``engine_id``; False when it did not
        (or that engine is gone: a new record of the same engine never held it)."""
        record = self._engines.get(engine_id)
        if record is None:
            return False
        requests = record.requests
        if request_id not in requests:
            return False
        load = len(requests)
        requests.remove(request_id)
        by_load = self._by_load
        if load < record.capacity:
            del by_load[load][record]
        else:
            self._in_turn[record] = None
        load -= 1
        by_load[load][record] = None
        if load < self.lowest_load:
            self.lowest_load = load
        return True

    # ------------------------------------------------------------ liveness

    def heard(self, record: EngineRecord) -> None:
        """A heartbeat from ``record``'s engine."""
        record.last_seen = time.monotonic()
        self._by_silence.move_to_end(record.engine_id)

    def heard_all(self) -> None:
        """Count every engine as just heard (after this coordinator's own connection was down)."""
        now = time.monotonic()
        for record in self._slots:
            record.last_seen = now

    def silent_since(self, cutoff: float) -> list[EngineRecord]:
        """Engines last heard before ``cutoff``; reads only those, plus one."""
        silent = []
        for record in self._by_silence.values():
            if record.last_seen >= cutoff:
                break
            silent.append(record)
        return silent

    # ------------------------------------------------------------ for routing policies

    def least_loaded(self) -> EngineRecord | None:
        """Fewest requests in flight among engines with room, equals in turn (``lowest_load`` is
        its load); None when all are full."""
        by_load = self._by_load
        lowest = self.lowest_load
        while lowest < len(by_load):
            bucket = by_load[lowest]
            if bucket:
                self.lowest_load = lowest
                return next(iter(bucket))
            lowest += 1
        self.lowest_load = lowest
        return None

    def next_in_turn(self) -> EngineRecord | None:
        """The engine with room that has waited longest for its turn; None when all are full."""
        in_turn = self._in_turn
        if not in_turn:
            return None
        record = next(iter(in_turn))
        in_turn.move_to_end(record)
        return record

    def sample_two(self) -> tuple[EngineRecord, EngineRecord]:
        """Two distinct engines uniformly at random, full or not (the same one twice when the
        pool has one); the pool must not be empty."""
        slots = self._slots
        count = len(slots)
        first = int(random.random() * count)
        if count == 1:
            return slots[0], slots[0]
        second = int(random.random() * (count - 1))
        if second >= first:
            second += 1
        return slots[first], slots[second]
