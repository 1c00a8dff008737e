"""The reply relay: engine replies on their way to clients.

Contract:
- Every accepted request leaves through exactly one terminal reply. Whoever takes it from the
  ledger (:meth:`.ledger.RequestLedger.finish`) sends it: the relay an engine's final, the
  ledger an error (:meth:`.ledger.RequestLedger.fail`: deadline, engine lost, shutdown).
  Finishing frees the engine slot and routes what waits for it (the ledger's job).
- The replies of one engine message leave together: batched for clients that read reply
  batches (:mod:`service.protocol.reply_batches`), in the order relayed.
- A stream's replies reach the client in order. Partials and finals travel on two subjects,
  so a final that overtook a partial waits for it (:data:`EARLY_FINAL_WAIT_S` at most).
- A reply is accepted only from the engine its request was routed to; the engine is the one the
  subject names (handlers/engine.py), so with per-engine NATS users no engine can answer for
  another (``stale_engine_replies`` counts the rest).
- Replies of an older run (``attempt``) than the request's current one are dropped
  (``stale_attempt_replies``). A stream's delivered tokens are kept, from each partial's
  ``tokens``, for a migration to resume after (:mod:`service.coordinator.fleet`), with their
  logprobs (``logprobs``) when the request asked for them; a partial without them, or after a
  lost one, makes the stream not resumable.
- A reply naming a live peer for a request this replica holds means that peer adopted it
  while this replica was taken for dead (its loop stalled): it leaves the ledger unanswered
  here (``requests_adopted_away``).
- A reply for a request this replica does not hold is an orphan: another live replica's (kept
  for a while, :mod:`service.coordinator.peer_replies`, in case that replica dies before it
  delivers it), this replica's own late reply (counted), or one whose coordinator is gone,
  which exactly one surviving replica, its adopter, delivers
  (:mod:`service.coordinator.adoption`), to an inbox only.
- Terminal replies of named clients are cached (:mod:`.answers`), so a resubmission is
  answered, never run twice; an orphan's only when its coordinator is one this replica heard
  from, so a forged orphan naming a made-up coordinator cannot answer a later resubmission.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from service.bus.batches import TOKEN_BYTES, logprob_size
from service.coordinator.answers import Answers
from service.coordinator.core import Core
from service.coordinator.ledger import RequestLedger
from service.coordinator.peer_replies import PeerReplies
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.requests import InflightRequest
from service.ops.log_limit import RateLimitedLog
from service.protocol.routed import RoutedReply
from service.protocol.subjects import ReplySubjects

log = logging.getLogger(__name__)

# How long a final that overtook one of its partials waits for it before going out anyway.
EARLY_FINAL_WAIT_S = 1.0


class ReplyRelay:
    def __init__(
        self,
        core: Core,
        ledger: RequestLedger,
        answers: Answers,
        peers: CoordinatorPeers,
        kept: PeerReplies,
        replies: ReplySubjects,
    ) -> None:
        self._id = core.id
        self._nc = core.nc
        self._counters = core.counters
        self._spawn = core.spawn
        self._ledger = ledger
        self._answers = answers
        self._peers = peers
        self._kept = kept
        self._replies = replies
        self._refusal_log = RateLimitedLog(log)

    async def relay_finals(self, engine_id: str, replies: list[RoutedReply]) -> None:
        await self._relay_all(engine_id, replies, self._relay_final)

    async def relay_partials(self, engine_id: str, replies: list[RoutedReply]) -> None:
        await self._relay_all(engine_id, replies, self._relay_partial)

    async def _relay_all(
        self,
        engine_id: str,
        replies: list[RoutedReply],
        relay: Callable[[str, RoutedReply], Awaitable[None]],
    ) -> None:
        """Relay one engine message's replies, batched per client (a lone one has nothing to share a batch with)."""
        if len(replies) == 1:
            await relay(engine_id, replies[0])
            return
        async with self._answers.batching():
            for reply in replies:
                await relay(engine_id, reply)

    async def _relay_final(self, engine_id: str, reply: RoutedReply) -> None:
        request_id = reply.return_path.request_id
        entry = self._ledger.get(request_id)
        if entry is None:
            await self._on_orphan(engine_id, reply, terminal=True)
            return
        if reply.return_path.coordinator_id != self._id and self._adopted_away(entry, reply):
            return
        if entry.engine_id != engine_id:
            self._counters["stale_engine_replies"] += 1
            return
        if entry.earlier_engines is not None and entry.stale(engine_id, reply.attempt):
            self._counters["stale_attempt_replies"] += 1
            return
        if entry.trace is not None:
            entry.trace.final_arrived()
        if reply.seq > entry.partials_delivered:
            entry.early_final = reply
            asyncio.get_running_loop().call_later(EARLY_FINAL_WAIT_S, self._send_early_final, request_id)
            return
        self._ledger.finish(request_id)
        await self._answers.final(entry, reply.body)

    async def _relay_partial(self, engine_id: str, reply: RoutedReply) -> None:
        entry = self._ledger.get(reply.return_path.request_id)
        if entry is None:
            await self._on_orphan(engine_id, reply, terminal=False)
            return
        if reply.return_path.coordinator_id != self._id and self._adopted_away(entry, reply):
            return
        if entry.engine_id != engine_id:
            self._counters["stale_engine_replies"] += 1
            return
        if entry.earlier_engines is not None and entry.stale(engine_id, reply.attempt):
            self._counters["stale_attempt_replies"] += 1
            return
        if not entry.streamed:
            self._ledger.latency.observe_first_token(entry.admitted_at)
        entry.streamed = True
        if entry.resumable:
            self._keep_tokens(entry, reply)
        await self._answers.send(entry.return_path, reply.body, terminal=False)
        entry.partials_delivered += 1
        early = entry.early_final
        if early is not None and early.seq <= entry.partials_delivered:
            self._ledger.finish(reply.return_path.request_id)
            await self._answers.final(entry, early.body)

    def _adopted_away(self, entry: InflightRequest, reply: RoutedReply) -> bool:
        """A reply naming a live peer for a request held here: that peer adopted it while this
        replica was taken for dead (its loop stalled), and answers it; it leaves this ledger
        without a reply."""
        holder = reply.return_path.coordinator_id
        if not self._peers.is_live(holder):
            return False  # a dead replica's request this one adopted: its earlier replies name it
        if self._ledger.finish(entry.return_path.request_id) is not None:
            self._counters["requests_adopted_away"] += 1
            log.warning("request_id=%s: adopted by coordinator %s; it answers", entry.return_path.request_id, holder)
        return True

    def _keep_tokens(self, entry: InflightRequest, reply: RoutedReply) -> None:
        """Keep a partial's tokens (and logprobs) for a migration, while they are known to follow
        on from the ones kept (no partial lost in between) and would fit one routed message."""
        tokens = reply.tokens
        kept = entry.streamed_tokens
        if tokens is None or reply.seq != entry.partials_delivered:
            kept = None
        elif kept is None:
            kept = entry.streamed_tokens = tokens
        else:
            kept.extend(tokens)
        size = 0
        if kept is not None and (reply.logprobs is not None or entry.streamed_logprobs is not None):
            size = _keep_logprobs(entry, kept, reply)
            if entry.streamed_logprobs is None:
                kept = None
        if kept is None or len(kept) * TOKEN_BYTES + size > self._nc.max_payload:
            entry.resumable = False
            entry.streamed_tokens = None
            entry.streamed_logprobs = None
            self._counters["streams_not_resumable"] += 1

    def _send_early_final(self, request_id: str) -> None:
        """The partial a final waited for never came: send the final, which carries every token."""
        entry = self._ledger.get(request_id)
        if entry is not None and entry.early_final is not None:
            self._counters["partials_lost"] += 1
            self._ledger.finish(request_id)
            self._spawn(self._answers.final(entry, entry.early_final.body))

    async def _on_orphan(self, engine_id: str, reply: RoutedReply, terminal: bool) -> None:
        return_path = reply.return_path
        owner_id = return_path.coordinator_id
        peers = self._peers
        if self._kept.holding(owner_id):  # being adopted, or (own id) naming this adopter already
            self._kept.keep(engine_id, reply, terminal)
            return
        if owner_id == self._id:
            if terminal:
                self._counters["late_replies"] += 1
                log.info("request_id=%s: engine reply after the request ended", return_path.request_id)
            return
        if not peers.warmed_up or peers.is_live(owner_id):
            self._kept.keep(engine_id, reply, terminal)
            return
        if peers.should_adopt(owner_id):
            await self.deliver_orphan(reply, terminal)

    async def deliver_orphan(self, reply: RoutedReply, terminal: bool) -> None:
        """Deliver a reply of a dead replica's request that no replica holds (this one adopted
        the dead one), to an inbox only."""
        return_path = reply.return_path
        owner, problem = self._replies.check(return_path.reply_to)
        if owner is None or problem is not None:
            # Admission refuses such a reply_to, so only an engine that rewrote the route gets here.
            self._counters["unsafe_reply_subject"] += 1
            self._refusal_log.warning(
                "request_id=%s: not delivering to reply subject %r, which %s",
                return_path.request_id,
                return_path.reply_to[:256],
                problem,
            )
            return
        self._counters["orphans_delivered"] += 1
        cache_owner = owner if self._peers.known(return_path.coordinator_id) else None
        await self._answers.send(return_path, reply.body, terminal, cache_owner)


def _keep_logprobs(entry: InflightRequest, kept: list[int], reply: RoutedReply) -> int:
    """Keep a partial's logprobs beside its tokens (``kept``, the stream's tokens with this
    partial's); their bytes, or 0 with ``streamed_logprobs`` dropped when they no longer cover
    every token kept (a partial without them: the stream cannot resume with them)."""
    held, new = entry.streamed_logprobs, reply.logprobs
    if new is None:
        entry.streamed_logprobs = None
        return 0
    if held is None:
        held = entry.streamed_logprobs = new  # the decoded reply's: kept as its tokens are
    else:
        held.token_logprobs.extend(new.token_logprobs)
        if held.top_logprobs is not None and new.top_logprobs is not None:
            held.top_logprobs.extend(new.top_logprobs)
    if len(held.token_logprobs) != len(kept) or (held.top_logprobs is not None) != (new.top_logprobs is not None):
        entry.streamed_logprobs = None
        return 0
    return logprob_size(held)
