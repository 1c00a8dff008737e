"""Requests the coordinator has accepted and not yet answered with a terminal reply.

Popping an entry is the right to send its terminal reply: whoever pops it answers, once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from service.coordinator.timers import CoarseTimer
from service.protocol.codec import Encoding
from service.protocol.messages import ClientRequestId, ReturnPath, RoutedReply

ClientKey = tuple[str | None, ClientRequestId]


@dataclass(slots=True, eq=False)
class InflightRequest:
    return_path: ReturnPath
    encoding: Encoding
    body: bytes
    client_key: ClientKey | None
    model: str | None = None  # routed only to engines serving it
    engine_id: str | None = None
    streamed: bool = False
    attempts: int = 0
    deadline: CoarseTimer | None = None
    routed_at: float = 0.0
    partials_delivered: int = 0
    early_final: RoutedReply | None = None  # arrived ahead of a partial still in flight
    admitted_at: float = field(default_factory=time.monotonic)  # for the latency histograms
    routing_key: Sequence[int] | None = None  # what the routing policy needs beyond loads (prefix hashes)


class RequestTable:
    def __init__(self) -> None:
        self._by_id: dict[str, InflightRequest] = {}
        self._by_client: dict[ClientKey, str] = {}

    def add(self, entry: InflightRequest) -> None:
        self._by_id[entry.return_path.request_id] = entry
        if entry.client_key is not None:
            self._by_client[entry.client_key] = entry.return_path.request_id

    def get(self, request_id: str) -> InflightRequest | None:
        return self._by_id.get(request_id)

    def find_client(self, key: ClientKey) -> InflightRequest | None:
        request_id = self._by_client.get(key)
        return None if request_id is None else self._by_id.get(request_id)

    def pop(self, request_id: str) -> InflightRequest | None:
        entry = self._by_id.pop(request_id, None)
        if entry is None:
            return None
        if entry.deadline is not None:
            entry.deadline.cancel()
        if entry.client_key is not None:
            self._by_client.pop(entry.client_key, None)
        return entry

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[InflightRequest]:
        return iter(list(self._by_id.values()))
