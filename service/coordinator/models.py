"""Routing by model name: the requests held for each model.

A submission that names a model goes only to engines that registered (or heartbeat) with that
``served_model_name`` (the pool keeps one :class:`~service.coordinator.pool.EngineGroup` per
model); one that names none may go to any engine. Requests waiting for room are held in one
queue per model named, so a model whose engines are all busy never holds back requests for
another.
"""

from __future__ import annotations

from collections import deque

from service.coordinator.requests import InflightRequest


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
