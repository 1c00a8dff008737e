"""The engine runtime: one data-parallel rank on NATS, driving a backend.

It registers with the coordinator, heartbeats its load and step count, runs routed requests
through the backend step by step, and sends one batched ``engine_reply_partial`` and one
batched ``engine_reply`` per step. Everything it sends the coordinator goes on
``<prefix>.<header>.<engine_id>``, so NATS permissions can let it speak only as itself.
Replies are encoded for the client here, from the return path each request carries, so the
coordinator only forwards bytes. Control signals are applied and confirmed; pause is a
barrier: its confirmation waits for the step in progress. Coordinator replicas broadcast
independently, so a control signal carries the revision of the shared control state it wrote,
and one older than the last applied is confirmed without effect.

Contract: every message is served by one guarded dispatch (:mod:`engines.runtime_dispatch`):
a malformed one is counted, logged and answered with an error ack, and the engine goes on. A
routed request this engine cannot serve gets its own error reply; the requests routed with it
are not affected. Every request gets exactly one terminal reply: the request table
(:mod:`engines.requests`) is the one owner of the requests held. The heartbeat and step loops
never die (:mod:`service.ops.loops`), and registration retries whatever goes wrong.

This class is the wiring and the lifecycle, on three floors (docs/architecture.md, *The engine
runtime, by job*): the owners of state (the request table, the control state, the weights)
on a shared core (:mod:`engines.runtime_core`); the jobs side by side above them, none
importing another (membership, intake, step loop, control, weight updates), where one needs
another's action the wiring passes that one callable in; and this class, which also provides
the broadcast handlers' context (:class:`engines.handlers.EngineContext`) as the jobs' own
methods.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from engines.backend import Backend
from engines.control_state import ControlState
from engines.handlers import ENGINE_HANDLERS
from engines.kv_prefixes import PublishedPrefixes
from engines.replies import ReplyPublisher
from engines.requests import RequestTable
from engines.runtime_control import ControlSignals
from engines.runtime_core import EngineCore, Route
from engines.runtime_dispatch import EngineDispatch
from engines.runtime_intake import RequestIntake
from engines.runtime_kv import KvPublisher
from engines.runtime_membership import Membership
from engines.runtime_steps import StepLoop
from engines.runtime_weights import WeightUpdates
from engines.token_pace import TokenPace
from engines.weight_updates import EngineWeights
from service.bus.connection import close_nats, connect_nats, flush_subscriptions
from service.bus.direct import DirectClient
from service.bus.registry import Incoming
from service.ops.log_limit import RateLimitedLog
from service.ops.loops import keep_running
from service.ops.settings import Settings
from service.ops.tracing import start_tracing
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect, ResendReplies
from service.protocol.messages import Empty
from service.protocol.routed import EngineAck, RoutedAbort, RoutedHold, RoutedRequestBatch
from service.protocol.subjects import KV_SNAPSHOT, RESEND_REPLIES, Header, Subjects

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer

log = logging.getLogger(__name__)


class EngineRuntime:
    """One data-parallel rank: its jobs wired, its lifecycle, and what others read of it."""

    def __init__(self, settings: Settings, backend: Backend, tracer: Tracer | None = None) -> None:
        """``tracer``: where this engine's spans go; by default from settings (None: tracing off)."""
        self.settings = settings
        self.backend = backend
        self.engine_id = settings.engine_id or f"e{uuid.uuid4().hex[:12]}"
        self.served_model_name = settings.served_model_name or backend.default_model_name
        self.subjects = Subjects(settings.subject_prefix)
        self.counters: Counter[str] = Counter()
        self.nc = DirectClient()
        self._tasks: set[asyncio.Future[None]] = set()
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self._failure_log = RateLimitedLog(log)
        connected = asyncio.Event()
        connected.set()
        self._owns_tracer = tracer is None
        self.tracer = tracer if tracer is not None else start_tracing(settings, "dpcoord-engine")
        core = EngineCore(
            self.engine_id,
            settings,
            backend,
            self.nc,
            self.subjects,
            self.counters,
            self._spawn,
            asyncio.Event(),
            connected,
            asyncio.Lock(),
            self.tracer,
        )
        self._core = core
        # Floor 1: the owners of state. The request table owns every request this engine holds.
        self.control_state = ControlState()
        self.weights = EngineWeights(self.engine_id, backend, core.step_lock)
        publisher = ReplyPublisher(self.engine_id, self.nc, self.subjects, self.counters, settings.recent_replies_bytes)
        self.requests = RequestTable(self.engine_id, backend, publisher, self.counters, settings.stream_interval)
        requests = self.requests
        self.kv_prefixes = PublishedPrefixes(self.engine_id)  # what its KV events told, for a prefix cache
        publishes_kv = backend.publishes_kv_events
        # Floor 2: the jobs, side by side; none imports another.
        self._kv_events = KvPublisher(core, self.kv_prefixes)
        self._steps = StepLoop(
            core, requests, self.control_state, self.weights, self._kv_events.publish if publishes_kv else None
        )
        self._membership = Membership(
            core,
            requests,
            self.control_state,
            self.weights,
            self.served_model_name,
            steps=lambda: self._steps.steps,
            kv_sequence=lambda: self.kv_prefixes.sequence if publishes_kv else None,
        )
        self._intake = RequestIntake(core, requests, self.control_state)
        self._signals = ControlSignals(
            core,
            requests,
            self.control_state,
            publish_unsent=self._steps.publish_unsent,
            stop_heartbeats=self._membership.stop_heartbeats,
        )
        self._weight_updates = WeightUpdates(self.weights, requests, rejoin=self._membership.rejoin)
        # The broadcast handlers' context (engines/handlers.py): each job's own method.
        self.pause = self._signals.pause
        self.unpause = self._signals.unpause
        self.suspend = self._signals.suspend
        self.resume = self._signals.resume
        self.stop_serving = self._signals.stop_serving
        self.set_epoch = self._signals.set_epoch
        self.start_profiler = self._signals.start_profiler
        self.stop_profiler = self._signals.stop_profiler
        self.hand_over = self._signals.hand_over
        self.prepare_weights = self._weight_updates.prepare
        self.discard_weights = self._weight_updates.discard
        self.commit_weights = self._weight_updates.commit
        # Messages routed to this engine alone go straight to the intake.
        routed: dict[str, Route[Any]] = {
            Header.SUBMIT_REQUEST: Route.to(RoutedRequestBatch, self._intake.start_batch),
            Header.ABORT_REQUEST: Route.to(RoutedAbort, self._intake.abort),
            Header.HOLD_REQUEST: Route.to(RoutedHold, self._intake.hold),
            RESEND_REPLIES: Route.to(ResendReplies, self._intake.resend),
        }
        if publishes_kv:
            routed[KV_SNAPSHOT] = Route.to(Empty, self._kv_events.snapshot)
        self._dispatch = EngineDispatch(core, routed, ENGINE_HANDLERS, self, self._signals.superseded)

    # ------------------------------------------------------------ state others read

    @property
    def registered(self) -> asyncio.Event:
        """Set once a coordinator added this engine to its pool."""
        return self._membership.registered

    @property
    def paused(self) -> bool:
        return self.control_state.paused

    @property
    def epoch(self) -> int | None:
        return self.control_state.epoch

    @property
    def load(self) -> int:
        return len(self.requests)

    @property
    def pace(self) -> TokenPace:
        """Tokens generated and the time between a request's tokens (the step loop's)."""
        return self._steps.pace

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await connect_nats(
            self.settings,
            name=f"dpcoord-engine-{self.engine_id}",
            on_disconnect=self._core.connected.clear,
            on_reconnect=self._on_reconnect,
            nc=self.nc,
        )
        await self._dispatch.subscribe()
        await flush_subscriptions(self.nc)
        self._spawn(self._membership.heartbeats())
        self._spawn(keep_running("step", self._steps.step_once, self.counters))
        self._spawn(self._membership.register())
        log.info("engine_id=%s started with backend %s", self.engine_id, self.backend.name)

    async def run_until_stopped(self) -> None:
        await self._stop_requested.wait()

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def stop(self, reason: str = "shutdown") -> None:
        """Leave the pool: tell the coordinator, which re-routes what this engine had not answered."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.nc.is_connected:
            await self._steps.publish_unsent()
        if self.nc.is_connected or self.nc.is_reconnecting:
            if self.nc.is_connected:
                await self.nc.publish(
                    self.subjects.sent_by(Header.DISCONNECT, self.engine_id),
                    encode_msgpack(EngineDisconnect(self.engine_id, reason)),
                )
            await close_nats(self.nc)
        await self.backend.close()
        if self.tracer is not None and self._owns_tracer:
            await asyncio.to_thread(self.tracer.close)  # exports what is left: off the event loop
        log.info("engine_id=%s stopped (%s)", self.engine_id, reason)

    async def __aenter__(self) -> EngineRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` until the engine stops; if it fails, the failure is logged and counted."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.counters["task_errors"] += 1
            self._failure_log.exception("engine_id=%s: background task failed", self.engine_id, exc=exc)

    def _on_reconnect(self) -> None:
        self._core.connected.set()
        self._core.wake.set()

    # ------------------------------------------------------------ the broadcast handlers' answers

    async def confirm(self, incoming: Incoming, detail: str = "") -> None:
        await self._core.answer(incoming.reply, EngineAck(self.engine_id, incoming.header, True, detail))

    async def acknowledge(self, incoming: Incoming, ack: EngineAck) -> None:
        await self._core.answer(incoming.reply, ack)
