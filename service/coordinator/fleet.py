"""The engine fleet as this replica sees it: joining, heartbeats, silence, and reconciliation.

Contract:
- An engine joins with zero load, serving the model it names, when it registers, or when a
  heartbeat introduces it to a replica that did not know it (say, one that restarted). A heartbeat sent just before an
  engine left on purpose never brings it back; only registering again does.
- An engine silent for ``heartbeat_timeout_s`` is removed, except while this replica's own
  NATS connection is down, or just after its own loop stalled (:mod:`.stalls`): then the
  silence is ours. Engines found silent together leave the pool together.
- A removed engine's requests that had not streamed are queued again (``max_retries``
  times), once every engine removed with it has left the pool. Those that had migrate: routed again as a new run (``attempt``) that resumes after
  the tokens already streamed (``resume_tokens``), at most ``max_migrations`` times; beyond
  that, or when the stream cannot resume (a partial lost, or one from an engine of an earlier
  release), they fail with 503.
- A heartbeat that no longer lists a request routed to that engine a while ago starts a
  reconciliation: the engine sends its replies again, and what it never received is queued
  again (or migrates, if part of it was streamed; or fails, if it was routed ``max_retries``
  times already).
- An engine id becomes a subject token, so register refuses one outside the token charset or
  longer than ``max_id_bytes`` (400), and beyond ``max_engines`` engines (429); a heartbeat
  never adopts such an engine.
- Progress is watched: an engine that holds requests yet neither replied nor reported a step
  (heartbeat ``steps``) for ``engine_progress_timeout_s`` while the coordinator runs is
  suspected (a black hole). It is removed as if silent (what it had not streamed is routed
  again) and its heartbeats bring it back only after it answers something: a reply, such as
  the final of an abort it is sent for each request taken from it, or registering again. An
  engine whose every request is held by backpressure (heartbeat ``held``) rightly steps none
  of them: its heartbeats count as progress.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
from nats.errors import Error as NatsError

from service.coordinator.control_state import ControlState
from service.coordinator.core import Core
from service.coordinator.fleet_log import FleetLog
from service.coordinator.ledger import RequestLedger
from service.coordinator.pool import EnginePool, EngineRecord
from service.coordinator.requests import InflightRequest
from service.coordinator.stalls import Stalls
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import encode_msgpack, msgpack_decoder
from service.protocol.errors import ErrorCode, WireError
from service.protocol.membership import Heartbeat, ResendAnswer, ResendReplies, computes_logprobs
from service.protocol.state import CoordinatorState
from service.protocol.subjects import RESEND_REPLIES, id_problem

log = logging.getLogger(__name__)
_resend_answer_decoder = msgpack_decoder(ResendAnswer)


class Fleet:
    def __init__(
        self,
        core: Core,
        ledger: RequestLedger,
        pool: EnginePool,
        control: ControlState,
        stalls: Stalls | None = None,
    ) -> None:
        self._stalls = stalls
        self._settings = core.settings
        self._nc = core.nc
        self._subjects = core.subjects
        self.pool = pool
        self._ledger = ledger
        self._control = control
        self._counters = core.counters
        self._spawn = core.spawn
        self.changed = asyncio.Event()
        self._suspects: dict[str, float] = {}  # engine id -> when it was last heard
        self._refusals = RateLimitedLog(log)
        self._log = FleetLog(log)

    def add(
        self, engine_id: str, capacity: int, model: str | None, own_subjects: bool = True, logprobs: bool = False
    ) -> EngineRecord:
        record = self.pool.add(engine_id, capacity, model, own_subjects, logprobs)
        self.changed.set()
        self._log.joined(engine_id, model, record.capacity, len(self.pool))
        return record

    def flush_log(self) -> None:
        """Log the joins and removals still being summed (the coordinator is stopping)."""
        self._log.flush()

    def speaker(self, sender: str | None, claimed: str) -> str:
        """The engine a message is from. On an engine's own subject, ``sender`` (the subject's
        last token) must be the engine the body names. On the plain subject of earlier releases
        (``sender`` None) the body names it, unless that engine speaks on its own subjects: only
        it may speak for itself. Raises WireError 403 otherwise."""
        if sender == claimed:
            return claimed
        if sender is None:
            record = self.pool.get(claimed)
            if record is None or not record.own_subjects:
                return claimed
            raise WireError(
                ErrorCode.FORBIDDEN, f"engine {claimed[:64]!r} sends on its own subjects, not on the plain one"
            )
        raise WireError(ErrorCode.FORBIDDEN, f"engine {sender[:64]!r} sent a message for engine {claimed[:64]!r}")

    async def register(
        self, engine_id: str, capacity: int, model: str | None, own_subjects: bool = True, logprobs: bool = False
    ) -> None:
        """An engine that registers again had restarted: its old work is lost. Raises WireError
        400 for an id that cannot be a subject token, 429 when the pool is full."""
        if (problem := id_problem(engine_id, self._settings.max_id_bytes)) is not None:
            raise WireError(ErrorCode.MALFORMED, f"engine_id {engine_id[:64]!r} {problem}")
        if self.pool.get(engine_id) is not None:
            await self.remove(engine_id, "registered again")
        elif len(self.pool) >= self._settings.max_engines:
            raise WireError(ErrorCode.OVERLOADED, f"engine pool full ({self._settings.max_engines} engines)")
        self._suspects.pop(engine_id, None)
        self.add(engine_id, capacity, model, own_subjects, logprobs)

    async def remove(self, engine_id: str, reason: str, departed: bool = True) -> None:
        """Drop an engine; requests it had not streamed are queued again, the rest fail."""
        await self.remove_many([engine_id], reason, departed)

    async def remove_many(self, engine_ids: list[str], reason: str, departed: bool = True) -> None:
        """Drop engines together: all leave the pool before any of their requests is routed
        again, so none goes to an engine that is leaving with the others (and spends a retry)."""
        records = [record for engine_id in engine_ids if (record := self.pool.remove(engine_id, departed)) is not None]
        if not records:
            return
        self.changed.set()
        ledger = self._ledger
        for record in records:
            engine_id = record.engine_id
            self._log.removed(engine_id, reason, record.load, len(self.pool))
            for request_id in list(record.requests):
                entry = ledger.get(request_id)
                if entry is None:
                    continue
                if entry.streamed:
                    await self._migrate(entry, f"engine {engine_id} lost ({reason})")
                elif entry.attempts <= self._settings.max_retries:
                    ledger.requeue(entry)
                    self._counters["retried"] += 1
                else:
                    await ledger.fail(request_id, WireError(ErrorCode.NO_ENGINE, f"engine {engine_id} lost ({reason})"))
        ledger.release()

    async def _migrate(self, entry: InflightRequest, lost: str) -> None:
        """Route a streamed request whose engine lost it again, to resume after the tokens it
        streamed; 503 when it cannot (a final that arrived ahead of a lost partial is sent instead)."""
        request_id = entry.return_path.request_id
        limit = self._settings.max_migrations
        problem = None
        if entry.early_final is not None:
            problem = "its final arrived"
        elif not entry.resumable:
            problem = "its stream cannot resume (a partial was lost, or its engine sent no tokens)"
        elif entry.migrations >= limit:
            problem = f"it was migrated max_migrations ({limit}) times already"
        if problem is not None:
            self._counters["migrations_refused"] += 1
            await self._ledger.fail(request_id, WireError(ErrorCode.NO_ENGINE, f"{lost}; {problem}"))
            return
        lost_on = entry.engine_id
        self._ledger.requeue(entry, migrated=True)
        self._counters["migrated"] += 1
        if lost_on is not None:  # should it still run (a partition, not a death), it stops
            await self._ledger.tell_engine_abort(lost_on, request_id)
        log.info(
            "request_id=%s: %s; migrating after %d streamed tokens (attempt %d)",
            request_id,
            lost,
            len(entry.streamed_tokens or ()),
            entry.attempt + 1,
        )

    async def heartbeat(self, heartbeat: Heartbeat, own_subjects: bool = True) -> None:
        """Refresh liveness; adopt an unknown engine (speaking on the subjects this heartbeat
        came on); reconcile, in the background, when the engine no longer holds requests routed
        to it."""
        engine_id = heartbeat.engine_id
        record = self.pool.get(engine_id)
        now = time.monotonic()
        if record is None:
            if engine_id in self._suspects:
                self._suspects[engine_id] = now
            elif not self.pool.recently_departed(engine_id) and self._adoptable(engine_id):
                logprobs = computes_logprobs(heartbeat.features)
                self.add(engine_id, heartbeat.capacity, heartbeat.served_model_name, own_subjects, logprobs)
                self._ledger.release()
            return
        self.pool.heard(record)
        if heartbeat.steps is not None and heartbeat.steps != record.steps:
            if record.steps is not None:
                record.last_progress = now
            record.steps = heartbeat.steps
        if heartbeat.held and record.requests.issubset(heartbeat.held):
            record.last_progress = now  # it rightly steps none of them: their readers hold them
        active = set(heartbeat.active)
        if not record.reconciling and not record.requests <= active:
            self._spawn(self.reconcile(record, active))

    def _adoptable(self, engine_id: str) -> bool:
        if id_problem(engine_id, self._settings.max_id_bytes) is not None:
            self._counters["heartbeats_refused"] += 1
            self._refusals.warning("heartbeat of engine_id %r not adopted: not a valid engine id", engine_id[:64])
            return False
        if len(self.pool) >= self._settings.max_engines:
            self._counters["heartbeats_refused"] += 1
            self._refusals.warning("heartbeat of engine_id %s not adopted: the pool is full", engine_id)
            return False
        return True

    def heard_from(self, engine_id: str) -> None:
        """A reply from ``engine_id``: it makes progress; a suspect is taken back by its next heartbeat."""
        record = self.pool.get(engine_id)
        if record is not None:
            record.last_progress = time.monotonic()
        elif self._suspects and self._suspects.pop(engine_id, None) is not None:
            log.warning("engine_id=%s answered again after it was suspected", engine_id)

    async def watch_once(self) -> None:
        """One round of the watchdog (run by :func:`~service.ops.loops.keep_running`): engines
        silent for ``heartbeat_timeout_s`` are removed (together), engines without progress
        suspected (each on its own, so one that fails to go does not keep the others). A round
        after this replica's own stall is skipped: the silence was its own (:mod:`.stalls`)."""
        timeout = self._settings.heartbeat_timeout_s
        since = time.monotonic()
        await asyncio.sleep(timeout / 4)
        if not self._nc.is_connected or (self._stalls is not None and self._stalls.slept(since, timeout / 4)):
            return
        now = time.monotonic()
        silent = [record.engine_id for record in self.pool.silent_since(now - timeout)]
        if silent:
            self._counters["engines_silent"] += len(silent)
            reason = f"no heartbeat for {timeout:g} s"
            await self._guarded(self.remove_many(silent, reason, departed=False), ", ".join(silent))
        for record in self._stalled(now):
            await self._guarded(self.suspect(record), record.engine_id)
        self._suspects = {engine_id: heard for engine_id, heard in self._suspects.items() if now - heard < timeout}

    async def _guarded(self, step: Coroutine[Any, Any, object], engine_id: str) -> None:
        try:
            await step
        except Exception:
            self._counters["watchdog_errors"] += 1
            self._refusals.warning(
                "engine_id=%s: the watchdog could not handle this engine; next round tries again", engine_id
            )

    def _stalled(self, now: float) -> list[EngineRecord]:
        """Engines holding requests that made no progress within ``engine_progress_timeout_s``.
        While the coordinator is not running engines do not step, so their clocks restart."""
        if self._control.state is not CoordinatorState.RUNNING:
            for record in self.pool:
                record.last_progress = now
            return []
        bound = self._settings.engine_progress_timeout_s
        return [record for record in self.pool if record.requests and now - record.last_progress > bound]

    async def suspect(self, record: EngineRecord) -> None:
        """No new work for an engine that holds requests and makes no progress; what it had not
        streamed goes elsewhere, and it is asked to abort that, which a live engine answers."""
        engine_id = record.engine_id
        taken = list(record.requests)
        self._counters["engines_suspected"] += 1
        bound = self._settings.engine_progress_timeout_s
        await self.remove(engine_id, f"no reply and no step for {bound:g} s with {len(taken)} requests", departed=False)
        self._suspects[engine_id] = time.monotonic()
        for request_id in taken:
            entry = self._ledger.get(request_id)
            if entry is not None and entry.engine_id != engine_id:
                await self._ledger.tell_engine_abort(engine_id, request_id)

    def forgive_silence(self) -> None:
        """After this replica's own reconnect, engines get a full timeout to be heard again, and
        to show progress."""
        self.pool.heard_all()
        now = time.monotonic()
        for record in self.pool:
            record.last_progress = now

    async def reconcile(self, record: EngineRecord, active: set[str]) -> None:
        """Requests routed to an engine a while ago that it no longer holds: their submission or
        their reply was lost (a NATS restart, say). Ask the engine to send its replies again;
        what it never received is queued again (or fails, if part of it was streamed)."""
        settled_before = time.monotonic() - 2 * self._settings.heartbeat_interval_s
        missing = [
            request_id
            for request_id in record.requests
            if request_id not in active
            and (entry := self._ledger.get(request_id)) is not None
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
        ledger = self._ledger
        for request_id in unknown:
            entry = ledger.get(request_id)
            if entry is None or entry.engine_id != record.engine_id:
                continue
            if entry.streamed:
                await self._migrate(entry, f"engine {record.engine_id} lost the request")
                continue
            if entry.attempts > self._settings.max_retries:
                await ledger.fail(
                    request_id, WireError(ErrorCode.NO_ENGINE, f"engine {record.engine_id} lost the request")
                )
                continue
            self._counters["redispatched"] += 1
            ledger.requeue(entry)
        ledger.release()

    async def remove_all(self, reason: str) -> None:
        await self.remove_many([record.engine_id for record in self.pool], reason)

    async def wait_for_engines(self, count: int, timeout_s: float = 10.0) -> None:
        async def reached() -> None:
            while len(self.pool) < count:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(reached(), timeout_s)
