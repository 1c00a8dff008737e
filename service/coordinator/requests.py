"""Requests the coordinator has accepted and not yet answered with a terminal reply: the
request ledger's table (:mod:`.ledger`, which alone changes it).

Popping an entry is the right to send its terminal reply: whoever pops it answers, once.

The table also keeps two tallies that must follow every way a request leaves: how many
requests (and body bytes) wait in the queue (admission's limits), and how many engine slots
each owner (the inbox prefix its replies go to) holds (``held``: the ledger counts a request in
when it routes it). ``unrouted``, ``enqueued`` and ``dequeued`` move an entry between those
states; :meth:`RequestTable.pop` settles both.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.coordinator.route_key import RouteKey
from service.coordinator.timers import CoarseTimer
from service.protocol.codec import Encoding
from service.protocol.logprobs import StreamedLogprobs
from service.protocol.messages import ClientRequestId
from service.protocol.routed import ReturnPath, RoutedReply

if TYPE_CHECKING:
    from service.ops.tracing.otel import CoordinatorTrace

ClientKey = tuple[str | None, ClientRequestId]


@dataclass(slots=True, eq=False)
class InflightRequest:
    return_path: ReturnPath
    encoding: Encoding
    body: bytes
    client_key: ClientKey | None
    model: str | None = None  # routed only to engines serving it
    owner: str = ""  # the inbox prefix its replies go to: only that owner may resubmit or abort it
    engine_id: str | None = None
    streamed: bool = False
    queued: bool = False
    attempts: int = 0
    deadline: CoarseTimer | None = None
    routed_at: float = 0.0
    partials_delivered: int = 0
    early_final: RoutedReply | None = None  # arrived ahead of a partial still in flight
    admitted_at: float = field(default_factory=time.monotonic)  # for the latency histograms
    routing_key: RouteKey | None = None  # what the routing policy needs beyond loads (prefix hashes, …)
    # A stream's delivered tokens, in order, from the partials' RoutedReply.tokens: a migration
    # resumes after them. None until the first; dropped when the stream cannot resume.
    streamed_tokens: list[int] | None = None
    resumable: bool = True  # False once a partial came without tokens or after a lost one
    logprobs: bool = False  # it asks for log-probabilities: routed only to engines that compute them
    # Their log-probabilities, aligned with streamed_tokens, for a request that asked for its
    # generated tokens' (a migration hands them to the next run).
    streamed_logprobs: StreamedLogprobs | None = None
    migrations: int = 0
    earlier_engines: list[str] | None = None  # engines that ran an earlier attempt of it
    trace: CoordinatorTrace | None = None  # its spans, when it is traced (service/ops/tracing)

    @property
    def attempt(self) -> int:
        """The run its current (or last) routing started: 0 first, one more per retry or migration."""
        return self.attempts - 1 if self.attempts else 0

    def new_run(self) -> None:
        """Its engine lost it: the next routing starts a new run, which streams from the first
        partial again (``seq`` 0); replies of older runs from this engine are recognised."""
        if self.engine_id is not None:
            if self.earlier_engines is None:
                self.earlier_engines = []
            self.earlier_engines.append(self.engine_id)
        self.partials_delivered = 0
        self.early_final = None

    def stale(self, engine_id: str, attempt: int) -> bool:
        """A reply from ``engine_id`` of an older run than the current one."""
        earlier = self.earlier_engines
        return earlier is not None and attempt < self.attempt and engine_id in earlier


class RequestTable:
    def __init__(self) -> None:
        self._by_id: dict[str, InflightRequest] = {}
        self._by_client: dict[ClientKey, str] = {}
        # owner -> engine slots its requests hold; owners at zero stay until forget_idle_owners
        self.held: defaultdict[str, int] = defaultdict(int)
        self.queued_count = 0
        self.queued_bytes = 0

    def add(self, entry: InflightRequest) -> None:
        self._by_id[entry.return_path.request_id] = entry
        if entry.client_key is not None:
            self._by_client[entry.client_key] = entry.return_path.request_id

    def get(self, request_id: str) -> InflightRequest | None:
        return self._by_id.get(request_id)

    def find_client(self, key: ClientKey) -> InflightRequest | None:
        request_id = self._by_client.get(key)
        return None if request_id is None else self._by_id.get(request_id)

    def client_keys(self) -> list[ClientKey]:
        """The ids of the requests held that name a ``client_request_id``."""
        return list(self._by_client)

    def pop(self, request_id: str) -> InflightRequest | None:
        entry = self._by_id.pop(request_id, None)
        if entry is None:
            return None
        if entry.deadline is not None:
            entry.deadline.cancel()
        if entry.client_key is not None:
            self._by_client.pop(entry.client_key, None)
        if entry.queued:
            self.dequeued(entry)
        if entry.engine_id is not None:  # its slot is free again (as unrouted, inlined: every request passes here)
            self.held[entry.owner] -= 1
        return entry

    # ------------------------------------------------------------ where it is

    def unrouted(self, entry: InflightRequest) -> None:
        """``entry``'s engine no longer holds it (it goes back to the queue)."""
        self.held[entry.owner] -= 1

    def held_by(self, owner: str) -> int:
        return self.held.get(owner, 0)

    def forget_idle_owners(self) -> None:
        """Drop the tallies of owners holding no slot (housekeeping: the hot path leaves them)."""
        self.held = defaultdict(int, {owner: count for owner, count in self.held.items() if count})

    def enqueued(self, entry: InflightRequest) -> None:
        entry.queued = True
        self.queued_count += 1
        self.queued_bytes += len(entry.body)

    def dequeued(self, entry: InflightRequest) -> None:
        entry.queued = False
        self.queued_count -= 1
        self.queued_bytes -= len(entry.body)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[InflightRequest]:
        return iter(list(self._by_id.values()))
