"""Replies to other replicas' requests, kept for a while in case their owner dies.

Every replica sees every engine reply (fan-out); a reply to a request another live replica
owns is that replica's to deliver. But a replica may die between a reply's arrival and its
delivery, and it is known dead only a heartbeat timeout later: replies dropped meanwhile
would leave holes in its streams. So each replica keeps the replies of its peers' requests
until the owner has surely dealt with them: until the owner was heard ``margin_s`` after
they arrived. The replies of a peer that falls silent are kept from then on, and the adopter
of a dead peer (:mod:`service.coordinator.adoption`) takes them and delivers them in order.
Some were delivered by the owner before it died; clients drop what they already have by the
partials' offsets (docs/reliability.md).

Bounded by bytes: beyond ``max_bytes`` the oldest kept reply goes (``peer_replies_dropped``).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from service.bus.batches import item_size
from service.protocol.routed import RoutedReply


@dataclass(slots=True, frozen=True)
class KeptReply:
    engine_id: str
    reply: RoutedReply
    terminal: bool
    arrived_at: float
    size: int


class PeerReplies:
    def __init__(
        self,
        last_heard: Callable[[str], float | None],
        margin_s: float,
        max_bytes: int,
        counters: Counter[str],
    ) -> None:
        self._last_heard = last_heard
        self._margin_s = margin_s
        self._max_bytes = max_bytes
        self._counters = counters
        self._by_peer: dict[str, deque[KeptReply]] = {}
        self._bytes = 0
        # Ids whose replies are kept whatever else holds, by how many adoptions hold them: dead
        # peers being adopted, and this replica itself, which engines name once they handed over.
        self._held: Counter[str] = Counter()

    def hold(self, peer: str) -> None:
        """Keep ``peer``'s replies although it is dead: this replica is adopting its requests."""
        self._held[peer] += 1

    def release(self, peer: str) -> None:
        self._held[peer] -= 1
        if self._held[peer] <= 0:
            del self._held[peer]

    def holding(self, peer: str) -> bool:
        return peer in self._held

    def peers(self) -> list[str]:
        """The peers some replies are kept for."""
        return list(self._by_peer)

    def keep(self, engine_id: str, reply: RoutedReply, terminal: bool) -> None:
        """Keep a reply to a request of the peer its return path names."""
        peer = reply.return_path.coordinator_id
        kept = self._by_peer.get(peer)
        if kept is None:
            kept = self._by_peer[peer] = deque()
        size = item_size(reply.body, reply.return_path)
        kept.append(KeptReply(engine_id, reply, terminal, time.monotonic(), size))
        self._bytes += size
        self._trim(peer, kept)
        while self._bytes > self._max_bytes and kept:
            self._bytes -= kept.popleft().size
            self._counters["peer_replies_dropped"] += 1

    def take(self, peer: str) -> list[KeptReply]:
        """Every reply kept for ``peer``'s requests, in arrival order; forgotten here."""
        kept = self._by_peer.pop(peer, None)
        if kept is None:
            return []
        self._bytes -= sum(item.size for item in kept)
        return list(kept)

    def trim(self) -> None:
        """Housekeeping (each heartbeat): forget what live owners have surely dealt with."""
        for peer, kept in list(self._by_peer.items()):
            self._trim(peer, kept)
            if not kept:
                del self._by_peer[peer]

    def _trim(self, peer: str, kept: deque[KeptReply]) -> None:
        heard = self._last_heard(peer)
        if heard is None:
            return  # silent or unknown: everything is kept for its adopter
        horizon = heard - self._margin_s
        while kept and kept[0].arrived_at < horizon:
            self._bytes -= kept.popleft().size

    @property
    def bytes(self) -> int:
        return self._bytes
