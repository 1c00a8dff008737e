"""The coordinator's view of live engines: capacity, in-flight requests, last heartbeat."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class EngineRecord:
    engine_id: str
    capacity: int
    last_seen: float = field(default_factory=time.monotonic)
    requests: set[str] = field(default_factory=set)

    @property
    def load(self) -> int:
        return len(self.requests)

    @property
    def has_room(self) -> bool:
        return len(self.requests) < self.capacity


class EnginePool:
    def __init__(self, max_inflight_per_engine: int) -> None:
        self._max_inflight = max_inflight_per_engine
        self._engines: dict[str, EngineRecord] = {}
        self.ordered: list[EngineRecord] = []

    def add(self, engine_id: str, capacity: int) -> EngineRecord:
        """Adds a fresh record with zero load; an existing one must be removed first."""
        record = EngineRecord(engine_id, min(capacity, self._max_inflight))
        self._engines[engine_id] = record
        self.ordered = list(self._engines.values())
        return record

    def remove(self, engine_id: str) -> EngineRecord | None:
        record = self._engines.pop(engine_id, None)
        if record is not None:
            self.ordered = list(self._engines.values())
        return record

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def silent_since(self, cutoff: float) -> list[EngineRecord]:
        return [record for record in self.ordered if record.last_seen < cutoff]

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[EngineRecord]:
        return iter(self.ordered)
