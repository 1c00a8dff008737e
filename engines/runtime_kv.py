"""KV events: what the engine's prefix cache holds, told to every coordinator replica
(docs/protocol.md, *KV events*), for a backend that has one (``Backend.publishes_kv_events``).

Contract: :meth:`KvPublisher.publish` is called by the step loop after every step and when it
goes idle (the wiring passes it in): it asks the backend what changed since it last asked and,
when something did, publishes one numbered message on ``<prefix>.kv_events.<engine_id>``
(:class:`~engines.kv_prefixes.PublishedPrefixes` numbers it and keeps the published set). While
NATS is unreachable it asks nothing, so the changes wait in the backend. A message that fails to
leave is logged and counted (``kv_events_failed``): its number is used, so the coordinators see
a gap and ask a snapshot. :meth:`KvPublisher.snapshot` answers ``kv_snapshot`` (routed here alone,
a request) from the published set: between steps, never waiting.
"""

from __future__ import annotations

import logging

from engines.kv_prefixes import PublishedPrefixes
from engines.runtime_core import EngineCore
from service.bus.registry import Incoming
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import encode_msgpack
from service.protocol.messages import Empty
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

# Bytes of one [prefix_hash, blocks] entry of a snapshot at most (msgpack), and of the rest.
SNAPSHOT_ENTRY_BYTES = 16
SNAPSHOT_OVERHEAD_BYTES = 1024


class KvPublisher:
    def __init__(self, core: EngineCore, published: PublishedPrefixes) -> None:
        self._core = core
        self._engine_id = core.engine_id
        self._backend = core.backend
        self._published = published
        self._subject = core.subjects.sent_by(Header.KV_EVENTS, core.engine_id)
        self._failure_log = RateLimitedLog(log)

    async def publish(self) -> None:
        """The backend's changes since the last call, as one numbered message, if any."""
        core = self._core
        if not core.connected.is_set():
            return
        events = self._published.events(self._backend.cache_changes())
        if events is None:
            return
        try:
            await core.nc.publish(self._subject, encode_msgpack(events))
        except Exception as exc:
            core.counters["kv_events_failed"] += 1
            self._failure_log.warning(
                "engine_id=%s: KV event %d not sent (%s); coordinators will ask a snapshot",
                self._engine_id,
                events.sequence,
                exc,
            )

    async def snapshot(self, incoming: Incoming, ask: Empty) -> None:
        """Sent by a coordinator replica (``kv_snapshot``, a request, body ``{}``) that lost this
        engine's numbering or meets it for the first time. Answers a ``KvSnapshot``: every prefix
        the events published so far hold (the least recently stored left out to stay under the
        server's ``max_payload``), the last event's number and the queued tokens."""
        entries = max(0, (self._core.nc.max_payload - SNAPSHOT_OVERHEAD_BYTES) // SNAPSHOT_ENTRY_BYTES)
        await self._core.answer(incoming.reply, self._published.snapshot(entries))
