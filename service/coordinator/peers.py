"""Other coordinator replicas on the same NATS, known by their heartbeats.

A reply whose coordinator is gone (killed, or restarted under a new id) is an orphan; the
live replica with the lowest id adopts the dead one's requests and delivers its orphans, so
exactly one replica does (:mod:`service.coordinator.adoption`). Only an orphan of a
coordinator this replica has heard from (:meth:`CoordinatorPeers.known`) may enter the result
cache: anyone can send a reply naming a made-up coordinator, and a cached forgery would answer
the next resubmission of that request.

"Known dead" survives this replica's own reconnect: while it was cut off it heard no one, so
its peers' clocks restart when it is back (:meth:`CoordinatorPeers.restart_clocks`), as the
engines' do; a peer is dead only after a whole heartbeat timeout of silence this replica
could have heard. A peer silent for ``suspect_after_s`` is suspected: requests that are not
held here may still turn out to be its, so lookups wait (:meth:`CoordinatorPeers.suspected`).

Both memories are bounded: at most ``max_peers`` live peers (more heartbeats from new ids are
ignored and counted by the caller) and as many remembered ones, the least recent forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict

MAX_PEERS = 1024


class CoordinatorPeers:
    def __init__(
        self, own_id: str, timeout_s: float, suspect_after_s: float | None = None, max_peers: int = MAX_PEERS
    ) -> None:
        self._own_id = own_id
        self._timeout_s = timeout_s
        self._suspect_after_s = timeout_s / 2 if suspect_after_s is None else suspect_after_s
        self._max_peers = max_peers
        self._last_seen: dict[str, float] = {}
        self._known: OrderedDict[str, None] = OrderedDict()  # every peer heard, most recent last
        self._departed: list[str] = []  # peers found dead since the last take_departed
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
        last_seen = self._last_seen
        if any(now - seen >= self._timeout_s for seen in last_seen.values()):
            self._departed.extend(peer for peer, seen in last_seen.items() if now - seen >= self._timeout_s)
            self._last_seen = {peer: seen for peer, seen in last_seen.items() if now - seen < self._timeout_s}
        return list(self._last_seen)

    def is_live(self, coordinator_id: str) -> bool:
        seen = self._last_seen.get(coordinator_id)
        return seen is not None and time.monotonic() - seen < self._timeout_s

    def last_heard(self, coordinator_id: str) -> float | None:
        """When a live peer was last heard (monotonic clock)."""
        return self._last_seen.get(coordinator_id)

    def suspected(self) -> bool:
        """Whether some live peer has been silent for ``suspect_after_s`` (it may be dead), or
        one was found dead that :meth:`take_departed` has not yet handed on."""
        now = time.monotonic()
        return bool(self._departed) or any(now - seen >= self._suspect_after_s for seen in self._last_seen.values())

    def take_departed(self) -> list[str]:
        """The peers found dead since the last call, each once."""
        self.live()
        departed, self._departed = self._departed, []
        return departed

    def left(self, coordinator_id: str) -> bool:
        """A peer said it stops: no longer live. False when it was not live here."""
        return self._last_seen.pop(coordinator_id, None) is not None

    def restart_clocks(self) -> None:
        """This replica is back on NATS after being cut off, when it could hear no one: every
        live peer's silence counts from now, so none is taken for dead for what it missed."""
        now = time.monotonic()
        self._last_seen = dict.fromkeys(self._last_seen, now)

    @property
    def warmed_up(self) -> bool:
        """Only after a heartbeat timeout has this replica heard every live peer."""
        return time.monotonic() - self._started_at >= self._timeout_s

    def should_adopt(self, owner_id: str) -> bool:
        live = self.live()
        return owner_id not in live and min([self._own_id, *live]) == self._own_id
