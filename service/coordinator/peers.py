"""Other coordinator replicas on the same NATS, known by their heartbeats.

A reply whose coordinator is gone (killed, or restarted under a new id) is an orphan; the
live replica with the lowest id delivers it, so exactly one replica does.
"""

from __future__ import annotations

import time


class CoordinatorPeers:
    def __init__(self, own_id: str, timeout_s: float) -> None:
        self._own_id = own_id
        self._timeout_s = timeout_s
        self._last_seen: dict[str, float] = {}
        self._started_at = time.monotonic()

    def saw(self, coordinator_id: str) -> None:
        if coordinator_id != self._own_id:
            self._last_seen[coordinator_id] = time.monotonic()

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
