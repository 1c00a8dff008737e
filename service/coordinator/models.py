"""Routing by model name: which engines serve which model, and the requests held for each.

A submission that names a model goes only to engines that registered (or heartbeat) with that
``served_model_name``; one that names none may go to any engine. Requests waiting for room are
held in one queue per model named, so a model whose engines are all busy never holds back
requests for another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from service.coordinator.pool import EngineRecord
from service.coordinator.requests import InflightRequest
from service.protocol.messages import ServedModel


class ModelRoutes:
    """The engines serving each model, kept in step with the pool by the coordinator."""

    def __init__(self) -> None:
        self._engines: dict[str, list[EngineRecord]] = {}

    def add(self, record: EngineRecord) -> None:
        if record.model is not None:
            self._engines.setdefault(record.model, []).append(record)

    def remove(self, record: EngineRecord) -> None:
        serving = self._engines.get(record.model) if record.model is not None else None
        if serving is None or record not in serving:
            return
        serving.remove(record)
        if not serving:
            del self._engines[record.model]  # type: ignore[arg-type]  # not None: checked above

    def engines_for(self, model: str) -> Sequence[EngineRecord] | None:
        """The engines serving ``model``; None when no engine does."""
        return self._engines.get(model)

    def names(self) -> list[str]:
        return sorted(self._engines)

    def served(self) -> list[ServedModel]:
        return [
            ServedModel(name, len(records), sum(r.capacity for r in records), sum(r.load for r in records))
            for name, records in sorted(self._engines.items())
        ]


class HeldRequests:
    """Requests waiting for an engine, first in first out within each model named (None: any)."""

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[InflightRequest]] = {}
        self._count = 0

    def append(self, entry: InflightRequest) -> None:
        self._queues.setdefault(entry.model, deque()).append(entry)
        self._count += 1

    def appendleft(self, entry: InflightRequest) -> None:
        """Back to the front of its queue: a request whose engine was lost keeps its turn."""
        self._queues.setdefault(entry.model, deque()).appendleft(entry)
        self._count += 1

    def queues(self) -> list[tuple[str | None, deque[InflightRequest]]]:
        """A snapshot: routing a held request may fail another one, which changes the queues."""
        return list(self._queues.items())

    def popleft(self, model: str | None) -> InflightRequest:
        queue = self._queues[model]
        entry = queue.popleft()
        self._count -= 1
        if not queue:
            del self._queues[model]
        return entry

    def __len__(self) -> int:
        return self._count
