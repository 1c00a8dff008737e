"""Adoption: the requests of a dead coordinator replica go on through the live replica with
the lowest id.

Contract:
- A peer is adopted once this replica knows it dead (a whole heartbeat timeout of silence it
  could have heard, :mod:`service.coordinator.peers`) and is the lowest live id; the other
  survivors forget the replies they kept for it.
- The adopter broadcasts ``adopt`` to every engine it knows, and waits for each until it
  answers or leaves the pool (found dead meanwhile). Each engine hands over the dead
  replica's requests (their return paths, bodies and how many partials it sent) and names the
  adopter in their replies from then on. The adopter holds them as its own: deadline, engine
  slot, resubmissions and aborts (forwarded by the other replicas, :mod:`.forwarding`), and
  migration when their engine dies.
- While it adopts, the replies of the dead replica's requests, and replies naming this replica
  for requests it does not hold yet, are kept (:mod:`.peer_replies`). Then every kept reply is
  delivered in arrival order: through the relay for a request it now holds (from the partials
  the dead replica may not have delivered: clients drop duplicates by their offsets), to its
  inbox for one no engine holds any more (its final came after its owner died).
- Once it ends, ``adopted`` is called: the arbitration sends its claims, adopted ids included.
- Requests the dead replica held that no engine had received (queued, or on their way) are
  known to their clients alone: the client library resubmits them when their coordinator
  stops heartbeating (:mod:`service.client`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from service.coordinator.answers import Answers
from service.coordinator.broadcast import broadcast
from service.coordinator.core import Core
from service.coordinator.ledger import RequestLedger
from service.coordinator.peer_replies import KeptReply, PeerReplies
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.pool import EnginePool
from service.coordinator.relay import ReplyRelay
from service.coordinator.requests import InflightRequest
from service.protocol.codec import Encoding, encode_msgpack
from service.protocol.handover import Adoption as AdoptionMessage
from service.protocol.routed import AdoptedRequest
from service.protocol.subjects import ADOPT, ReplySubjects

log = logging.getLogger(__name__)

# Dead peers remembered as adopted, so each is adopted once; the least recent are forgotten.
MAX_ADOPTED = 1024


class Adoption:
    def __init__(
        self,
        core: Core,
        ledger: RequestLedger,
        answers: Answers,
        pool: EnginePool,
        peers: CoordinatorPeers,
        kept: PeerReplies,
        relay: ReplyRelay,
        replies: ReplySubjects,
        adopted: Callable[[], None] = lambda: None,
    ) -> None:
        self._adopted_hook = adopted
        self._core = core
        self._ledger = ledger
        self._answers = answers
        self._pool = pool
        self._peers = peers
        self._kept = kept
        self._relay = relay
        self._replies = replies
        self._adopted: OrderedDict[str, None] = OrderedDict()
        self._in_progress = 0

    @property
    def adopting(self) -> bool:
        """Adopting a dead peer's requests now."""
        return self._in_progress > 0

    @property
    def settling(self) -> bool:
        """Adopting a peer now, or missing a peer's heartbeats: a request not held here now may
        become this replica's in a moment."""
        return self._in_progress > 0 or self._peers.suspected()

    def departed(self, dead: str) -> None:
        """A peer was found dead: adopt its requests (settling from this moment on), or forget
        what was kept for it."""
        if not self._peers.should_adopt(dead):
            self._kept.take(dead)
            return
        if dead in self._adopted:
            return
        self._adopted[dead] = None
        if len(self._adopted) > MAX_ADOPTED:
            self._adopted.popitem(last=False)
        self._in_progress += 1
        self._kept.hold(dead)
        self._kept.hold(self._core.id)
        self._core.spawn(self._adopt(dead))

    async def _adopt(self, dead: str) -> None:
        core = self._core
        try:
            expected = {record.engine_id for record in self._pool}
            result = await broadcast(
                core.nc,
                core.subjects.broadcast(ADOPT),
                encode_msgpack(AdoptionMessage(dead, core.id)),
                expected,
                core.settings.control_timeout_s,
                still_expected=lambda engine_id: self._pool.get(engine_id) is not None,
            )
            adopted = {
                item.return_path.request_id: (engine_id, item)
                for engine_id, ack in result.acks.items()
                for item in ack.adopted or ()
            }
            kept = sorted(self._kept.take(dead) + self._kept.take(core.id), key=lambda item: item.arrived_at)
            for engine_id, handed in adopted.values():
                self._hold(engine_id, handed)
        finally:
            self._kept.release(dead)
            self._kept.release(core.id)
            self._in_progress -= 1
            self._adopted_hook()
        core.counters["peers_adopted"] += 1
        core.counters["requests_adopted"] += len(adopted)
        log.warning(
            "adopted coordinator %s: %d requests from %d engines (%d silent: %s), %d kept replies",
            dead,
            len(adopted),
            len(result.acks),
            len(result.missing),
            ", ".join(sorted(result.missing)) or "none",
            len(kept),
        )
        handed_at = {request_id: handed.partials_sent for request_id, (_, handed) in adopted.items()}
        for kept_reply in kept:
            await self._deliver(dead, kept_reply, handed_at)

    def _hold(self, engine_id: str, item: AdoptedRequest) -> None:
        """Hold a handed-over request as if this replica had routed it: its state (partials
        sent, tokens streamed, run) is the engine's at the handover."""
        return_path = item.return_path
        if return_path.request_id in self._ledger:
            return
        owner, problem = self._replies.check(return_path.reply_to)
        if owner is None or problem is not None:
            self._core.counters["unsafe_reply_subject"] += 1
            return
        client_key = None
        if return_path.client_id is not None and return_path.client_request_id is not None:
            client_key = (return_path.client_id, return_path.client_request_id)
        entry = InflightRequest(
            return_path,
            Encoding(return_path.encoding),
            item.body,
            client_key,
            owner=owner,
            streamed=item.partials_sent > 0,
            partials_delivered=item.partials_sent,
            streamed_tokens=list(item.tokens) if item.tokens else None,
            logprobs=item.logprobs is not None,
            streamed_logprobs=item.logprobs if item.logprobs is not None and item.logprobs.token_logprobs else None,
        )
        self._ledger.hold_adopted(entry, engine_id, item.attempt)

    async def _deliver(self, dead: str, item: KeptReply, handed_at: dict[str, int]) -> None:
        """A kept reply: a partial the engine sent before the handover goes to the client as it
        is (the request's state already counts it); anything later through the relay."""
        reply = item.reply
        request_id = reply.return_path.request_id
        entry = self._ledger.get(request_id)
        if entry is not None:
            if not item.terminal and reply.seq < handed_at.get(request_id, 0):
                await self._answers.send(entry.return_path, reply.body, terminal=False)
            elif item.terminal:
                await self._relay.relay_finals(item.engine_id, [reply])
            else:
                await self._relay.relay_partials(item.engine_id, [reply])
        elif reply.return_path.coordinator_id == dead:
            await self._relay.deliver_orphan(reply, item.terminal)
