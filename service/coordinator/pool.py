"""The coordinator's view of live engines: capacity, in-flight requests, last heartbeat."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class EngineRecord:
    engine_id: str
    capacity: int
    model: str | None = None  # the model it serves (engines older than model names report none)
    last_seen: float = field(default_factory=time.monotonic)
    requests: set[str] = field(default_factory=set)
    reconciling: bool = False

    @property
    def load(self) -> int:
        return len(self.requests)

    @property
    def has_room(self) -> bool:
        return len(self.requests) < self.capacity


class EnginePool:
    """Live engines, plus recently departed ones: a heartbeat sent just before an engine left
    must not bring it back (only registering again does)."""

    def __init__(self, max_inflight_per_engine: int, departed_memory_s: float) -> None:
        self._max_inflight = max_inflight_per_engine
        self._departed_memory_s = departed_memory_s
        self._engines: dict[str, EngineRecord] = {}
        self._departed: dict[str, float] = {}
        self.ordered: list[EngineRecord] = []

    def add(self, engine_id: str, capacity: int, model: str | None = None) -> EngineRecord:
        """Adds a fresh record with zero load; an existing one must be removed first."""
        record = EngineRecord(engine_id, min(capacity, self._max_inflight), model)
        self._engines[engine_id] = record
        self._departed.pop(engine_id, None)
        self.ordered = list(self._engines.values())
        return record

    def remove(self, engine_id: str, departed: bool) -> EngineRecord | None:
        """``departed``: the engine left on purpose, so its stray heartbeats must not re-add it.
        An engine removed for silence is taken back by its next heartbeat."""
        record = self._engines.pop(engine_id, None)
        if record is not None:
            self.ordered = list(self._engines.values())
            if departed:
                now = time.monotonic()
                self._departed = {e: t for e, t in self._departed.items() if now - t < self._departed_memory_s}
                self._departed[engine_id] = now
        return record

    def recently_departed(self, engine_id: str) -> bool:
        departed_at = self._departed.get(engine_id)
        return departed_at is not None and time.monotonic() - departed_at < self._departed_memory_s

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def silent_since(self, cutoff: float) -> list[EngineRecord]:
        return [record for record in self.ordered if record.last_seen < cutoff]

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[EngineRecord]:
        return iter(self.ordered)
