"""Routing by model name: the requests held for each model.

A submission that names a model goes only to engines that registered (or heartbeat) with that
``served_model_name`` (the pool keeps one :class:`~service.coordinator.pool.EngineGroup` per
model); one that names none may go to any engine. Requests waiting for room are held in one
queue per model named, so a model whose engines are all busy never holds back requests for
another; within a model, owners take turns.
"""

from __future__ import annotations

from service.coordinator.fair_queue import FairQueue
from service.coordinator.requests import InflightRequest, RequestTable


class HeldRequests:
    """Requests waiting for an engine: one fair queue (owners in turn, fair_queue.py) per model
    named (None: any)."""

    def __init__(self, requests: RequestTable) -> None:
        self._requests = requests
        self.by_model: dict[str | None, FairQueue] = {}  # a model in it may have requests waiting

    def append(self, entry: InflightRequest) -> None:
        self._queue(entry.model).append(entry)

    def appendleft(self, entry: InflightRequest) -> None:
        """Back to the front: a request whose engine was lost keeps its turn."""
        self._queue(entry.model).appendleft(entry)

    def _queue(self, model: str | None) -> FairQueue:
        queue = self.by_model.get(model)
        if queue is None:
            queue = self.by_model[model] = FairQueue(self._requests)
        return queue

    def queues(self) -> list[tuple[str | None, FairQueue]]:
        """A snapshot: routing a held request may fail another one, which changes the queues."""
        return list(self.by_model.items())

    def discard(self, model: str | None) -> None:
        """Forget ``model``'s queue, which :meth:`FairQueue.peek` found empty."""
        self.by_model.pop(model, None)

    def __len__(self) -> int:
        """Requests waiting, for every model, not counting those answered while they waited."""
        return self._requests.queued_count
