"""The bytes a request's client receives, and the abort its engine is told: the mechanics of
answering, without the decision of who answers (that is the ledger's, :mod:`.ledger`).

Contract:
- :meth:`Answers.send` publishes one reply along a return path, through the deliveries that
  hold replies while NATS is down (:mod:`.deliveries`). A terminal reply is counted
  (``completed``), cached for a named client's resubmissions when an owner is given
  (:mod:`.results`), and followed by the empty message that ends a stream. Inside
  :meth:`Answers.batching`, replies to clients that read reply batches leave batched.
- :meth:`Answers.replay` sends a cached terminal reply again (``replayed``).
- :meth:`Answers.tell_engine_abort` is best effort: the request is answered already, so a
  failed publish is only logged and counted (``engine_aborts_lost``).
"""

from __future__ import annotations

import logging

from service.coordinator.core import Core
from service.coordinator.deliveries import Batching, ClientDeliveries
from service.coordinator.requests import ClientKey, InflightRequest
from service.coordinator.results import CachedResult, ResultCache
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import encode, encode_msgpack
from service.protocol.errors import WireError
from service.protocol.messages import Final, error_reply
from service.protocol.routed import ReturnPath, RoutedAbort
from service.protocol.subjects import Header

log = logging.getLogger(__name__)


class Answers:
    def __init__(self, core: Core, deliveries: ClientDeliveries, results: ResultCache) -> None:
        self._core = core
        self._counters = core.counters
        self._deliveries = deliveries
        self._results = results
        self._failures = RateLimitedLog(log)

    async def send(
        self,
        return_path: ReturnPath,
        body: bytes,
        terminal: bool,
        owner: str | None = None,
        request_body: bytes | None = None,
    ) -> None:
        """Send one reply along ``return_path``; a terminal reply of a named client is cached
        for ``owner`` (None: not cached)."""
        client_key = None
        if return_path.client_id is not None and return_path.client_request_id is not None:
            client_key = (return_path.client_id, return_path.client_request_id)
        batched = return_path.batched
        await self._deliveries.publish(return_path.reply_to, body, client_key, batched)
        if terminal:
            self._counters["completed"] += 1
            if client_key is not None and owner is not None:
                self._results.put(client_key, body, owner, request_body)
            if return_path.stream:
                await self._deliveries.publish(return_path.reply_to, b"", client_key, batched)

    async def final(self, entry: InflightRequest, body: bytes) -> None:
        """``entry``'s terminal reply, ``body`` as its engine wrote it; a traced request's spans end."""
        await self.send(entry.return_path, body, True, entry.owner, entry.body)
        if entry.trace is not None:
            entry.trace.answered()

    async def error(self, entry: InflightRequest, err: WireError) -> None:
        """``entry``'s terminal reply: ``err``, in the encoding it came in."""
        self._counters[f"failed_{err.code}"] += 1
        request_id = entry.return_path.request_id
        log.info("request_id=%s engine_id=%s failed: %s", request_id, entry.engine_id, err)
        if entry.trace is not None:
            entry.trace.failed(err.code, err.message)
        message = error_reply(err, entry.return_path.client_request_id, request_id)
        await self.final(entry, encode(message, entry.encoding))

    async def aborted(self, entry: InflightRequest) -> None:
        """``entry``'s terminal reply: the ``abort`` final of a request no engine held."""
        return_path = entry.return_path
        final = Final(return_path.request_id, return_path.client_request_id, None, [], "", "abort")
        await self.final(entry, encode(final, entry.encoding))

    def batching(self) -> Batching:
        """Replies sent inside the block to clients that read reply batches leave batched at its end."""
        return self._deliveries.batching()

    def cached(self, client_key: ClientKey) -> CachedResult | None:
        return self._results.get(client_key)

    def repoint(self, client_key: ClientKey, reply_to: str) -> bool:
        """A held (undelivered) reply of ``client_key`` goes to ``reply_to`` instead; False when none is held."""
        return self._deliveries.repoint(client_key, reply_to)

    async def replay(self, client_key: ClientKey, cached: CachedResult, reply_to: str, stream: bool) -> None:
        """Send a named client's cached terminal reply again."""
        self._counters["replayed"] += 1
        await self._deliveries.publish(reply_to, cached.body, client_key)
        if stream:
            await self._deliveries.publish(reply_to, b"", client_key)

    async def tell_engine_abort(self, engine_id: str, request_id: str) -> None:
        subject = self._core.subjects.engine(engine_id, Header.ABORT_REQUEST)
        try:
            await self._core.nc.publish(subject, encode_msgpack(RoutedAbort(request_id)))
        except Exception as exc:
            self._counters["engine_aborts_lost"] += 1
            self._failures.warning("engine_id=%s request_id=%s: abort not sent: %s", engine_id, request_id, exc)
