"""Other coordinator replicas on the same NATS, known by their heartbeats.

A reply whose coordinator is gone (killed, or restarted under a new id) is an orphan; the
live replica with the lowest id delivers it, so exactly one replica does. Only an orphan of a
coordinator this replica has heard from (:meth:`CoordinatorPeers.known`) may enter the result
cache: anyone can send a reply naming a made-up coordinator, and a cached forgery would answer
the next resubmission of that request.

Both memories are bounded: at most ``max_peers`` live peers (more heartbeats from new ids are
ignored and counted by the caller) and as many remembered ones, the least recent forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict

MAX_PEERS = 1024


class CoordinatorPeers:
    def __init__(self, own_id: str, timeout_s: float, max_peers: int = MAX_PEERS) -> None:
        self._own_id = own_id
        self._timeout_s = timeout_s
        self._max_peers = max_peers
        self._last_seen: dict[str, float] = {}
        self._known: OrderedDict[str, None] = OrderedDict()  # every peer heard, most recent last
        self._started_at = time.monotonic()

    def saw(self, coordinator_id: str) -> bool:
        """Note a heartbeat; False when it was ignored because too many peers are live."""
        if coordinator_id == self._own_id:
            return True
        now = time.monotonic()
        if coordinator_id not in self._last_seen and len(self._last_seen) >= self._max_peers:
            self.live()
            if len(self._last_seen) >= self._max_peers:
                return False
        self._last_seen[coordinator_id] = now
        known = self._known
        known[coordinator_id] = None
        known.move_to_end(coordinator_id)
        if len(known) > self._max_peers:
            known.popitem(last=False)
        return True

    def known(self, coordinator_id: str) -> bool:
        """This replica itself, or a peer it has heard (recently enough to remember)."""
        return coordinator_id == self._own_id or coordinator_id in self._known

    def live(self) -> list[str]:
        """The other replicas heard within the heartbeat timeout."""
        now = time.monotonic()
        self._last_seen = {peer: seen for peer, seen in self._last_seen.items() if now - seen < self._timeout_s}
        return list(self._last_seen)

    @property
    def warmed_up(self) -> bool:
        """Only after a heartbeat timeout has this replica heard every live peer."""
        return time.monotonic() - self._started_at >= self._timeout_s

    def should_adopt(self, owner_id: str) -> bool:
        live = self.live()
        return owner_id not in live and min([self._own_id, *live]) == self._own_id
