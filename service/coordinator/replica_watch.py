"""This replica among its peers: its heartbeat, and what follows from theirs.

Contract: each beat publishes this replica's heartbeat (while connected; it says whether the
replica arbitrates request ids, :mod:`.arbitration`, whose beat follows; a replica joins the
arbitration once its quiet time has passed, and beats at once then), forgets the kept
replies live peers have surely dealt with, and hands every peer found dead to adoption
(:mod:`.adoption`), once this replica has been up a heartbeat timeout (before that, silence
proves nothing). At that moment, the peers whose replies were kept but that were never heard
are handed over too (they died before this replica started). After this replica's own
reconnect its peers' clocks restart (:meth:`.peers.CoordinatorPeers.restart_clocks`). A
replica that stops while peers live says so in a last beat (``leaving``), and the lowest of
them adopts its requests at once.
"""

from __future__ import annotations

import asyncio
import logging

from service.coordinator.adoption import Adoption
from service.coordinator.arbitration import Arbitration
from service.coordinator.core import Core
from service.coordinator.peer_replies import PeerReplies
from service.coordinator.peers import CoordinatorPeers
from service.protocol.codec import encode_msgpack
from service.protocol.membership import CoordinatorHeartbeat
from service.protocol.subjects import Header

log = logging.getLogger(__name__)


class ReplicaWatch:
    def __init__(
        self, core: Core, peers: CoordinatorPeers, kept: PeerReplies, adoption: Adoption, arbitration: Arbitration
    ) -> None:
        self._core = core
        self._peers = peers
        self._kept = kept
        self._adoption = adoption
        self._arbitration = arbitration
        self._subject = core.subjects.coordinator(Header.COORDINATOR_HEARTBEAT)

    def start(self, quiet_s: float) -> None:
        """Join the arbitration as soon as the quiet time ends (:mod:`.arbiters`)."""
        asyncio.get_running_loop().call_later(quiet_s, lambda: self._core.spawn(self.join()))

    async def join(self) -> None:
        """Arbitrate once the quiet time has passed, and say so at once: until its peers hear it,
        they hand this replica nothing."""
        if self._arbitration.join() and self._core.nc.is_connected:
            await self.publish()
        await self._arbitration.beat()

    async def beat(self) -> None:
        self._arbitration.join()
        self._kept.trim()
        if self._peers.warmed_up:
            for dead in self._peers.take_departed():
                self._adoption.departed(dead)
                self._arbitration.departed(dead)
        nc = self._core.nc
        if nc.is_connected:
            await self.publish()
        await self._arbitration.beat()

    async def publish(self) -> None:
        """This replica's heartbeat, saying whether it arbitrates request ids."""
        beat = CoordinatorHeartbeat(self._core.id, arbitrates=self._arbitration.arbitrating)
        await self._core.nc.publish(self._subject, encode_msgpack(beat))

    def warmed_up(self) -> None:
        for peer in self._kept.peers():
            if peer != self._core.id and not self._peers.is_live(peer):
                self._adoption.departed(peer)

    def reconnected(self) -> None:
        self._peers.restart_clocks()

    def left(self, peer: str) -> None:
        """A peer's last beat: it stops, so its requests are adopted now, not a timeout later."""
        if peer != self._core.id and self._peers.left(peer):
            self._arbitration.departed(peer)
            if self._peers.warmed_up:
                self._adoption.departed(peer)
            self._core.spawn(self._arbitration.beat())

    async def leave(self) -> None:
        """This replica's last beat, as it stops while peers live: they adopt its requests."""
        await self._core.nc.publish(self._subject, encode_msgpack(CoordinatorHeartbeat(self._core.id, leaving=True)))

    async def stop_arbitrating(self, timeout_s: float) -> None:
        """As it stops while peers live: its claims go to its peers, then a heartbeat saying it
        arbitrates no longer, so they hand it nothing more. Each live peer is then asked its
        status (within ``timeout_s``): its answer comes after the heartbeat was read there, and
        after any copy it handed here before, which this replica hands on while it still listens."""
        await self._arbitration.stop_arbitrating()
        await self.publish()
        nc, subjects = self._core.nc, self._core.subjects
        asked = [
            nc.request(subjects.status("coordinator", peer), b"", timeout=timeout_s) for peer in self._peers.live()
        ]
        for outcome in await asyncio.gather(*asked, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.info("a peer did not answer while this replica stopped arbitrating: %r", outcome)
