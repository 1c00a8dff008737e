"""The engine fleet as this replica sees it: joining, heartbeats, silence, and reconciliation.

Contract:
- An engine joins with zero load, serving the model it names, when it registers, or when a
  heartbeat introduces it to a replica that did not know it (say, one that restarted). A heartbeat sent just before an
  engine left on purpose never brings it back; only registering again does.
- An engine silent for ``heartbeat_timeout_s`` is removed, except while this replica's own
  NATS connection is down: then the silence is ours.
- A removed engine's requests that had not streamed are queued again (``max_retries``
  times); the others fail with 503.
- A heartbeat that no longer lists a request routed to that engine a while ago starts a
  reconciliation: the engine sends its replies again, and what it never received is queued
  again (or fails, if part of it was streamed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from nats.errors import Error as NatsError

from service.bus.direct import DirectClient
from service.coordinator.admission import Admission
from service.coordinator.fleet_log import FleetLog
from service.coordinator.pool import EnginePool, EngineRecord
from service.coordinator.relay import ReplyRelay
from service.coordinator.requests import RequestTable
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack, msgpack_decoder
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import Heartbeat, ResendAnswer, ResendReplies
from service.protocol.subjects import RESEND_REPLIES, Subjects

log = logging.getLogger(__name__)
_resend_answer_decoder = msgpack_decoder(ResendAnswer)


class Fleet:
    def __init__(
        self,
        settings: Settings,
        nc: DirectClient,
        subjects: Subjects,
        pool: EnginePool,
        requests: RequestTable,
        admission: Admission,
        relay: ReplyRelay,
        counters: Counter[str],
        spawn: Callable[[Coroutine[Any, Any, object]], None],
    ) -> None:
        self._settings = settings
        self._nc = nc
        self._subjects = subjects
        self.pool = pool
        self._requests = requests
        self._admission = admission
        self._relay = relay
        self._counters = counters
        self._spawn = spawn
        self.changed = asyncio.Event()
        self._log = FleetLog(log)

    def add(self, engine_id: str, capacity: int, model: str | None) -> EngineRecord:
        record = self.pool.add(engine_id, capacity, model)
        self.changed.set()
        self._log.joined(engine_id, model, record.capacity, len(self.pool))
        return record

    def flush_log(self) -> None:
        """Log the joins and removals still being summed (the coordinator is stopping)."""
        self._log.flush()

    async def register(self, engine_id: str, capacity: int, model: str | None) -> None:
        """An engine that registers again had restarted: its old work is lost."""
        if self.pool.get(engine_id) is not None:
            await self.remove(engine_id, "registered again")
        self.add(engine_id, capacity, model)

    async def remove(self, engine_id: str, reason: str, departed: bool = True) -> None:
        """Drop an engine; requests it had not streamed are queued again, the rest fail."""
        record = self.pool.remove(engine_id, departed)
        if record is None:
            return
        self.changed.set()
        self._log.removed(engine_id, reason, record.load, len(self.pool))
        for request_id in record.requests:
            entry = self._requests.get(request_id)
            if entry is None:
                continue
            if not entry.streamed and entry.attempts <= self._settings.max_retries:
                self._admission.requeue(entry)
                self._counters["retried"] += 1
            else:
                await self._relay.fail(
                    request_id, WireError(ErrorCode.NO_ENGINE, f"engine {engine_id} lost ({reason})")
                )
        await self._admission.release_queue()

    async def heartbeat(self, heartbeat: Heartbeat) -> None:
        """Refresh liveness; adopt an unknown engine; reconcile, in the background, when the
        engine no longer holds requests routed to it."""
        record = self.pool.get(heartbeat.engine_id)
        if record is None:
            if not self.pool.recently_departed(heartbeat.engine_id):
                self.add(heartbeat.engine_id, heartbeat.capacity, heartbeat.served_model_name)
                await self._admission.release_queue()
            return
        self.pool.heard(record)
        active = set(heartbeat.active)
        if not record.reconciling and not record.requests <= active:
            self._spawn(self.reconcile(record, active))

    async def watch_heartbeats(self) -> None:
        """The silence watchdog; one failed round is logged and the next goes on."""
        timeout = self._settings.heartbeat_timeout_s
        while True:
            await asyncio.sleep(timeout / 4)
            if not self._nc.is_connected:
                continue
            try:
                for record in self.pool.silent_since(time.monotonic() - timeout):
                    await self.remove(record.engine_id, f"no heartbeat for {timeout:g} s", departed=False)
            except Exception:
                log.exception("heartbeat watchdog round failed; continuing")

    def forgive_silence(self) -> None:
        """After this replica's own reconnect, engines get a full timeout to be heard again."""
        self.pool.heard_all()

    async def reconcile(self, record: EngineRecord, active: set[str]) -> None:
        """Requests routed to an engine a while ago that it no longer holds: their submission or
        their reply was lost (a NATS restart, say). Ask the engine to send its replies again;
        what it never received is queued again (or fails, if part of it was streamed)."""
        settled_before = time.monotonic() - 2 * self._settings.heartbeat_interval_s
        missing = [
            request_id
            for request_id in record.requests
            if request_id not in active
            and (entry := self._requests.get(request_id)) is not None
            and entry.routed_at < settled_before
        ]
        if not missing:
            return
        subject = self._subjects.engine(record.engine_id, RESEND_REPLIES)
        record.reconciling = True
        try:
            msg = await self._nc.request(
                subject, encode_msgpack(ResendReplies(missing)), timeout=self._settings.control_timeout_s
            )
            unknown = _resend_answer_decoder.decode(msg.data).unknown
        except (NatsError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("engine_id=%s: resend of %d replies not answered: %s", record.engine_id, len(missing), exc)
            return
        finally:
            record.reconciling = False
        self._counters["replies_resent"] += len(missing) - len(unknown)
        for request_id in unknown:
            entry = self._requests.get(request_id)
            if entry is None or entry.engine_id != record.engine_id:
                continue
            self.pool.release(record.engine_id, request_id)
            if entry.streamed:
                await self._relay.fail(
                    request_id, WireError(ErrorCode.NO_ENGINE, f"engine {record.engine_id} lost the request")
                )
                continue
            self._counters["redispatched"] += 1
            self._admission.requeue(entry)
        await self._admission.release_queue()

    async def remove_all(self, reason: str) -> None:
        for record in list(self.pool):
            await self.remove(record.engine_id, reason)

    async def wait_for_engines(self, count: int, timeout_s: float = 10.0) -> None:
        async def reached() -> None:
            while len(self.pool) < count:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(reached(), timeout_s)
