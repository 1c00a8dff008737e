"""The queue of requests waiting for an engine: one line per owner, served in turn.

An owner is the inbox prefix a request's replies go to (:class:`service.protocol.subjects.InboxPrefixes`),
which per-user NATS permissions make a client's identity. Owners take turns, so one client's
thousand queued requests do not make another's one request wait behind them; and an owner
already holding more than its share of the fleet's slots is passed over while others wait
(``over_share``). Requests in one owner's line keep their order.

A request answered while it waits (deadline, abort, shutdown) stays in its line until its turn
comes or the lines are compacted; the counts and bytes that admission limits are the live ones
in :class:`~service.coordinator.requests.RequestTable`. The request ledger (:mod:`.ledger`)
owns the queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from service.coordinator.requests import InflightRequest, RequestTable

# Lines are rebuilt without answered requests once these outnumber the live ones by this many.
COMPACT_SLACK = 1024


class FairQueue:
    def __init__(self, requests: RequestTable) -> None:
        self._requests = requests
        self._lines: OrderedDict[str, deque[InflightRequest]] = OrderedDict()  # owners, next in turn first
        self._held = 0  # entries in the lines, answered ones included

    def __len__(self) -> int:
        """Requests waiting, not counting those answered while they waited."""
        return self._requests.queued_count

    def append(self, entry: InflightRequest) -> None:
        line = self._lines.get(entry.owner)
        if line is None:
            line = self._lines[entry.owner] = deque()
        line.append(entry)
        self._added(entry)

    def appendleft(self, entry: InflightRequest) -> None:
        """First in its owner's line, and that owner first in turn: a request its engine lost."""
        line = self._lines.get(entry.owner)
        if line is None:
            line = self._lines[entry.owner] = deque()
        line.appendleft(entry)
        self._lines.move_to_end(entry.owner, last=False)
        self._added(entry)

    def _added(self, entry: InflightRequest) -> None:
        self._requests.enqueued(entry)
        self._held += 1
        if self._held > 2 * self._requests.queued_count + COMPACT_SLACK:
            self._compact()

    def peek(self, over_share: Callable[[str], bool]) -> InflightRequest | None:
        """The request to route next, left in place: the head of the first owner's line in turn
        that is not over its share, or of the first in turn when every waiting owner is."""
        first: InflightRequest | None = None
        for owner, line in list(self._lines.items()):
            while line and not line[0].queued:
                line.popleft()
                self._held -= 1
            if not line:
                del self._lines[owner]
                continue
            if first is None:
                first = line[0]
            if not over_share(owner):
                return line[0]
        return first

    def pop(self, entry: InflightRequest) -> None:
        """Take ``entry``, which :meth:`peek` returned, out of the queue; its owner's turn ends."""
        line = self._lines[entry.owner]
        line.popleft()
        self._held -= 1
        self._requests.dequeued(entry)
        if line:
            self._lines.move_to_end(entry.owner)
        else:
            del self._lines[entry.owner]

    def _compact(self) -> None:
        lines: OrderedDict[str, deque[InflightRequest]] = OrderedDict()
        for owner, line in self._lines.items():
            live = deque(entry for entry in line if entry.queued)
            if live:
                lines[owner] = live
        self._lines = lines
        self._held = sum(len(line) for line in lines.values())
