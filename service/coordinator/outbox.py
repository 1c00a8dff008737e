"""The outbox to engines: requests routed in one event-loop turn leave as one message per engine.

Contract: the ledger assigns a request to an engine at once (its slot is taken,
:mod:`.ledger`) and the request leaves at the end of the loop turn, with every other request
routed to that engine in the same turn, in batches under the server's ``max_payload``: the
routing task waits on the ledger's ``routed`` and publishes what :meth:`RequestLedger.take_routed`
hands over, which also ends the routing policy's turn (it prefers the engine already
receiving a batch within a turn, ``routing_load_slack``). The counters ``routed_messages`` and
``routed_requests`` say how many requests a routed message carries. Under load a batch holds
everything that arrived in one read from the socket. A request answered or routed elsewhere
before its turn ends is skipped; one too large to route fails with 413; a batch NATS refuses
fails its requests with 503 (both through the ledger). A routed request carries its run
(``attempt``) and, when it migrates, the tokens its stream already delivered
(``resume_tokens``), counted in its size. The routing task outlives any failure.

A traced request (:mod:`service.ops.tracing`) leaves alone, in a message of its own whose NATS
headers carry its ``traceparent`` (its route span's), so the engine continues its trace; with
tracing off nothing here looks at traces.
"""

from __future__ import annotations

import asyncio
import logging
from operator import itemgetter

from service.bus.batches import fits_alone, item_size, split_batches
from service.coordinator.core import Core
from service.coordinator.ledger import RequestLedger
from service.coordinator.requests import InflightRequest
from service.ops.log_limit import RateLimitedLog
from service.ops.tracing import TRACEPARENT
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.routed import FirstRun, RoutedRequest, RoutedRequestsOut
from service.protocol.subjects import Header

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, core: Core, ledger: RequestLedger) -> None:
        self._nc = core.nc
        self._subjects = core.subjects
        self._counters = core.counters
        self._tracing = core.tracer is not None
        self._ledger = ledger
        self._publishing = False  # the routing task is publishing a round
        self._failures = RateLimitedLog(log)

    async def route_once(self) -> None:
        """One round of the routing task (run by :func:`~service.ops.loops.keep_running`):
        publishes what the loop turns since the last round routed."""
        ledger = self._ledger
        await ledger.routed.wait()
        pending = ledger.take_routed()
        self._publishing = True
        try:
            for engine_id, entries in pending.items():
                try:
                    await self._publish(engine_id, entries)
                except Exception:
                    self._failures.exception("engine_id=%s: routing %d requests failed", engine_id, len(entries))
        finally:
            self._publishing = False

    async def sent(self, timeout_s: float) -> None:
        """Until every request routed so far has left for its engine (a replica about to leave
        its requests to its peers: an engine must hold them to hand them over), or ``timeout_s``."""
        give_up_at = asyncio.get_running_loop().time() + timeout_s
        while True:  # the routing task publishes them: nothing to wait on but the next look
            if (not self._ledger.routing and not self._publishing) or asyncio.get_running_loop().time() >= give_up_at:
                return
            await asyncio.sleep(0.01)

    async def _publish(self, engine_id: str, entries: list[InflightRequest]) -> None:
        max_payload = self._nc.max_payload
        still_routed = self._ledger.still_routed
        routable: list[tuple[InflightRequest, int]] = []  # with its size, counted once
        for entry in entries:
            if not still_routed(entry, engine_id):
                continue  # answered or routed elsewhere while it waited for this turn
            size = item_size(entry.body, entry.return_path, entry.streamed_tokens, entry.streamed_logprobs)
            if not fits_alone(size, max_payload):
                resumed = f" with {len(entry.streamed_tokens)} streamed tokens" if entry.streamed_tokens else ""
                await self._ledger.fail(
                    entry.return_path.request_id,
                    WireError(
                        ErrorCode.TOO_LARGE,
                        f"request of {len(entry.body)} bytes{resumed} does not fit NATS max_payload {max_payload} once routed",
                    ),
                )
                continue
            routable.append((entry, size))
        subject = self._subjects.engine(engine_id, Header.SUBMIT_REQUEST)
        if self._tracing:
            routable = await self._publish_traced(subject, engine_id, routable)
        for batch in split_batches(routable, itemgetter(1), max_payload):
            await self._publish_batch(subject, [entry for entry, _ in batch])

    async def _publish_traced(
        self, subject: str, engine_id: str, routable: list[tuple[InflightRequest, int]]
    ) -> list[tuple[InflightRequest, int]]:
        """Publish the traced requests of ``routable``, each alone with its ``traceparent``; the rest."""
        rest: list[tuple[InflightRequest, int]] = []
        for entry, size in routable:
            trace = entry.trace
            if trace is None:
                rest.append((entry, size))
                continue
            traceparent = trace.routed(engine_id, entry.attempt, entry.admitted_at, entry.routed_at)
            await self._publish_batch(subject, [entry], {TRACEPARENT: traceparent})
            trace.sent()
        return rest

    async def _publish_batch(
        self, subject: str, batch: list[InflightRequest], headers: dict[str, str] | None = None
    ) -> None:
        message = RoutedRequestsOut(
            [
                FirstRun(entry.return_path, entry.body)
                if entry.attempts == 1
                else RoutedRequest(
                    entry.return_path, entry.body, entry.attempt, entry.streamed_tokens, entry.streamed_logprobs
                )
                for entry in batch
            ]
        )
        try:
            await self._nc.publish(subject, encode_msgpack(message), headers=headers)
            self._counters["routed_messages"] += 1
            self._counters["routed_requests"] += len(batch)
        except Exception as exc:  # the routing task must outlive any one failed publish
            self._failures.warning("routing %d requests on %s failed: %s", len(batch), subject, exc)
            for entry in batch:
                await self._ledger.fail(
                    entry.return_path.request_id,
                    WireError(ErrorCode.NO_ENGINE, f"could not return_path to engine: {exc}"),
                )
