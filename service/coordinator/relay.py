"""The reply relay: engine replies on their way to clients, and every terminal reply.

Contract:
- Every accepted request leaves through exactly one terminal reply. Whoever pops it from the
  request table (:meth:`ReplyRelay.finish`) sends it: an engine's final, or an error from
  :meth:`ReplyRelay.fail` (deadline, engine lost, shutdown).
- A stream's replies reach the client in order. Partials and finals travel on two subjects,
  so a final that overtook a partial waits for it (:data:`EARLY_FINAL_WAIT_S` at most).
- A reply is accepted only from the engine its request was routed to; the engine is the one the
  subject names (handlers/engine.py), so with per-engine NATS users no engine can answer for
  another (``stale_engine_replies`` counts the rest).
- Replies of an older run (``attempt``) than the request's current one are dropped
  (``stale_attempt_replies``). A stream's delivered tokens are kept, from each partial's
  ``tokens``, for a migration to resume after (:mod:`service.coordinator.fleet`); a partial
  without them, or after a lost one, makes the stream not resumable.
- A reply for a request this replica does not hold is an orphan: another live replica's (kept
  for a while, :mod:`service.coordinator.peer_replies`, in case that replica dies before it
  delivers it), this replica's own late reply (counted), or one whose coordinator is gone,
  which exactly one surviving replica, its adopter, delivers
  (:mod:`service.coordinator.adoption`), to an inbox only.
- Terminal replies of named clients are cached, so a resubmission is answered, never run twice;
  an orphan's only when its coordinator is one this replica heard from, so a forged orphan
  naming a made-up coordinator cannot answer a later resubmission.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from service.bus.batches import TOKEN_BYTES
from service.bus.direct import DirectClient
from service.coordinator.deliveries import ClientDeliveries
from service.coordinator.peer_replies import PeerReplies
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.pool import EnginePool
from service.coordinator.requests import ClientKey, InflightRequest, RequestTable
from service.coordinator.results import CachedResult, ResultCache
from service.ops.latency import RequestLatency
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import encode, encode_msgpack
from service.protocol.errors import WireError
from service.protocol.messages import Final, ReturnPath, RoutedAbort, RoutedReply, error_reply
from service.protocol.subjects import Header, ReplySubjects, Subjects

log = logging.getLogger(__name__)

# How long a final that overtook one of its partials waits for it before going out anyway.
EARLY_FINAL_WAIT_S = 1.0


class ReplyRelay:
    def __init__(
        self,
        coordinator_id: str,
        nc: DirectClient,
        subjects: Subjects,
        requests: RequestTable,
        pool: EnginePool,
        peers: CoordinatorPeers,
        results: ResultCache,
        deliveries: ClientDeliveries,
        counters: Counter[str],
        spawn: Callable[[Coroutine[Any, Any, object]], None],
        replies: ReplySubjects,
        kept: PeerReplies,
    ) -> None:
        self._id = coordinator_id
        self._nc = nc
        self._subjects = subjects
        self._requests = requests
        self._pool = pool
        self._peers = peers
        self._results = results
        self._deliveries = deliveries
        self._counters = counters
        self._spawn = spawn
        self.latency = RequestLatency()
        self._refusal_log = RateLimitedLog(log)
        self._replies = replies
        self._kept = kept
        self.on_slot_freed: Callable[[], Awaitable[None]] | None = None

    def finish(self, request_id: str) -> InflightRequest | None:
        """Pop a request for its terminal reply and free its engine slot; None when another
        path already answered it."""
        entry = self._requests.pop(request_id)
        if entry is None:
            return None
        self.latency.observe_finished(entry.admitted_at)
        if entry.engine_id is not None:
            self._pool.release(entry.engine_id, request_id)
        return entry

    async def reply(
        self,
        return_path: ReturnPath,
        body: bytes,
        terminal: bool,
        owner: str | None = None,
        request_body: bytes | None = None,
    ) -> None:
        """Send one reply along ``return_path``: this replica's own (its reply subject was checked on
        admission), or an orphan's that :meth:`_on_orphan` checked, since an engine wrote it.
        A terminal reply of a named client is cached for ``owner`` (None: not cached)."""
        client_key = None
        if return_path.client_id is not None and return_path.client_request_id is not None:
            client_key = (return_path.client_id, return_path.client_request_id)
        await self._deliveries.publish(return_path.reply_to, body, client_key)
        if terminal:
            self._counters["completed"] += 1
            if client_key is not None and owner is not None:
                self._results.put(client_key, body, owner, request_body)
            if return_path.stream:
                await self._deliveries.publish(return_path.reply_to, b"", client_key)

    def cached(self, client_key: ClientKey) -> CachedResult | None:
        return self._results.get(client_key)

    async def replay(self, client_key: ClientKey, cached: CachedResult, reply_to: str, stream: bool) -> None:
        """Send a named client's cached terminal reply again."""
        self._counters["replayed"] += 1
        await self._deliveries.publish(reply_to, cached.body, client_key)
        if stream:
            await self._deliveries.publish(reply_to, b"", client_key)

    async def relay_finals(self, engine_id: str, replies: list[RoutedReply]) -> None:
        for reply in replies:
            await self._relay_final(engine_id, reply)
        if self.on_slot_freed is not None:
            await self.on_slot_freed()

    async def _relay_final(self, engine_id: str, reply: RoutedReply) -> None:
        request_id = reply.return_path.request_id
        entry = self._requests.get(request_id)
        if entry is None:
            await self._on_orphan(engine_id, reply, terminal=True)
            return
        if entry.engine_id != engine_id:
            self._counters["stale_engine_replies"] += 1
            return
        if entry.earlier_engines is not None and entry.stale(engine_id, reply.attempt):
            self._counters["stale_attempt_replies"] += 1
            return
        if reply.seq > entry.partials_delivered:
            entry.early_final = reply
            asyncio.get_running_loop().call_later(EARLY_FINAL_WAIT_S, self._send_early_final, request_id)
            return
        self.finish(request_id)
        await self.reply(entry.return_path, reply.body, True, entry.owner, entry.body)

    async def relay_partials(self, engine_id: str, replies: list[RoutedReply]) -> None:
        for reply in replies:
            await self._relay_partial(engine_id, reply)

    async def _relay_partial(self, engine_id: str, reply: RoutedReply) -> None:
        entry = self._requests.get(reply.return_path.request_id)
        if entry is None:
            await self._on_orphan(engine_id, reply, terminal=False)
            return
        if entry.engine_id != engine_id:
            self._counters["stale_engine_replies"] += 1
            return
        if entry.earlier_engines is not None and entry.stale(engine_id, reply.attempt):
            self._counters["stale_attempt_replies"] += 1
            return
        if not entry.streamed:
            self.latency.observe_first_token(entry.admitted_at)
        entry.streamed = True
        if entry.resumable:
            self._keep_tokens(entry, reply)
        await self.reply(entry.return_path, reply.body, terminal=False)
        entry.partials_delivered += 1
        early = entry.early_final
        if early is not None and early.seq <= entry.partials_delivered:
            self.finish(reply.return_path.request_id)
            await self.reply(entry.return_path, early.body, True, entry.owner, entry.body)

    def _keep_tokens(self, entry: InflightRequest, reply: RoutedReply) -> None:
        """Keep a partial's tokens for a migration, while they are known to follow on from the
        ones kept (no partial lost in between) and would fit one routed message."""
        tokens = reply.tokens
        kept = entry.streamed_tokens
        if tokens is None or reply.seq != entry.partials_delivered:
            kept = None
        elif kept is None:
            kept = entry.streamed_tokens = tokens
        else:
            kept.extend(tokens)
        if kept is None or len(kept) * TOKEN_BYTES > self._nc.max_payload:
            entry.resumable = False
            entry.streamed_tokens = None
            self._counters["streams_not_resumable"] += 1

    def _send_early_final(self, request_id: str) -> None:
        """The partial a final waited for never came: send the final, which carries every token."""
        entry = self._requests.get(request_id)
        if entry is not None and entry.early_final is not None:
            self._counters["partials_lost"] += 1
            self.finish(request_id)
            self._spawn(self.reply(entry.return_path, entry.early_final.body, True, entry.owner, entry.body))

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
        await self.reply(return_path, reply.body, terminal, cache_owner)

    async def fail(self, request_id: str, err: WireError) -> bool:
        """Answer an open request with ``err``; False when it was already answered.

        A final that arrived early, behind a lost partial, is the better answer, so it goes out instead."""
        entry = self.finish(request_id)
        if entry is None:
            return False
        if entry.early_final is not None:
            await self.reply(entry.return_path, entry.early_final.body, True, entry.owner, entry.body)
            return True
        self._counters[f"failed_{err.code}"] += 1
        log.info("request_id=%s engine_id=%s failed: %s", request_id, entry.engine_id, err)
        message = error_reply(err, entry.return_path.client_request_id, request_id)
        await self.reply(entry.return_path, encode(message, entry.encoding), True, entry.owner, entry.body)
        if entry.engine_id is not None:
            await self.tell_engine_abort(entry.engine_id, request_id)
        if self.on_slot_freed is not None:
            await self.on_slot_freed()
        return True

    async def abort(self, entry: InflightRequest) -> None:
        """A queued request ends here with an ``abort`` final; a routed one is aborted by its
        engine, whose final says ``abort``."""
        if entry.engine_id is not None:
            await self.tell_engine_abort(entry.engine_id, entry.return_path.request_id)
            return
        if self.finish(entry.return_path.request_id) is None:
            return
        final = Final(entry.return_path.request_id, entry.return_path.client_request_id, None, [], "", "abort")
        await self.reply(entry.return_path, encode(final, entry.encoding), True, entry.owner, entry.body)

    async def tell_engine_abort(self, engine_id: str, request_id: str) -> None:
        """Best effort: the request is answered already, so a failed publish is only logged."""
        subject = self._subjects.engine(engine_id, Header.ABORT_REQUEST)
        try:
            await self._nc.publish(subject, encode_msgpack(RoutedAbort(request_id)))
        except Exception as exc:
            self._counters["engine_aborts_lost"] += 1
            self._refusal_log.warning("engine_id=%s request_id=%s: abort not sent: %s", engine_id, request_id, exc)
