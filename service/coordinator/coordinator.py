"""The coordinator: the jobs its handlers drive, wired together, and the narrow contexts
handlers are typed against (:mod:`handlers.context`, checked by mypy).

Contract: every handler call is guarded (:mod:`.dispatch`): a message that fails to decode,
or that a handler refuses, becomes an error reply, a rate-limited log line and a counter, and
the coordinator keeps serving. Every accepted request leaves through exactly one terminal
reply, whose right the request ledger holds (:mod:`.ledger`, the one owner of a request's
life in this replica), from the replica that owns it or the one that adopted it
(:mod:`.ownership`, :mod:`.adoption`). Background loops never die (:mod:`service.ops.loops`),
and a background task that fails is logged and counted. This class owns the connection, the
background tasks and the lifecycle, and wires three floors (docs/architecture.md): the owners
of state (the ledger, the pool, the peers, …), the jobs side by side above them (admission,
outbox, relay, fleet, control, and enrolment, weight updates, ownership, forwarding, holds,
adoption and the replica watch composed of them), and this class.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from handlers.context import CoordinatorContext
from service.bus.connection import close_nats, connect_nats, flush_subscriptions
from service.bus.direct import DirectClient
from service.bus.registry import HandlerRegistry, Incoming
from service.coordinator.admission import Admission
from service.coordinator.adoption import Adoption
from service.coordinator.answers import Answers
from service.coordinator.arbiters import Arbiters
from service.coordinator.arbitration import Arbitration, quiet_s
from service.coordinator.block_index import BlockIndex
from service.coordinator.control import Control
from service.coordinator.control_state import ControlState
from service.coordinator.core import Core
from service.coordinator.deliveries import ClientDeliveries
from service.coordinator.dispatch import Dispatch
from service.coordinator.enrolment import Enrolment
from service.coordinator.fleet import Fleet
from service.coordinator.forwarding import Forwarding
from service.coordinator.holds import Holds
from service.coordinator.known_clients import KnownClients
from service.coordinator.kv_feed import KvFeed
from service.coordinator.ledger import RequestLedger
from service.coordinator.outbox import Outbox
from service.coordinator.ownership import Ownership
from service.coordinator.peer_replies import PeerReplies
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.pool import EnginePool
from service.coordinator.relay import ReplyRelay
from service.coordinator.replica_watch import ReplicaWatch
from service.coordinator.results import ResultCache
from service.coordinator.routing import make_policy
from service.coordinator.shared_state import SharedControlState
from service.coordinator.stalls import Stalls
from service.coordinator.weights import WeightUpdates
from service.ops.latency import RequestLatency
from service.ops.log_limit import RateLimitedLog
from service.ops.loops import keep_running
from service.ops.settings import Settings
from service.ops.tracing import start_tracing
from service.protocol.codec import encode
from service.protocol.errors import ErrorCode, WireError
from service.protocol.membership import Heartbeat
from service.protocol.messages import Ack, WeightVersion
from service.protocol.routed import RoutedReply
from service.protocol.state import CoordinatorState
from service.protocol.subjects import (
    Header,
    InboxPrefixes,
    ReplySubjects,
    Subjects,
    id_problem,
)

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(
        self, settings: Settings, handlers: HandlerRegistry[CoordinatorContext], tracer: Tracer | None = None
    ) -> None:
        """``tracer``: where this replica's spans go; by default from settings (None: tracing off)."""
        self.settings = settings
        self.id = settings.coordinator_id or f"c{uuid.uuid4().hex[:12]}"
        self.subjects = Subjects(settings.subject_prefix)
        self.counters: Counter[str] = Counter()
        self.nc = DirectClient()
        self.engines = EnginePool(settings.max_inflight_per_engine, departed_memory_s=2 * settings.heartbeat_timeout_s)
        self.peers = CoordinatorPeers(
            self.id, settings.heartbeat_timeout_s, min(2 * settings.heartbeat_interval_s, settings.heartbeat_timeout_s)
        )
        self.results = ResultCache(
            settings.result_ttl_s, settings.result_cache_size, settings.result_cache_bytes, settings.max_id_bytes
        )
        self.control_state = ControlState()
        self.inboxes = InboxPrefixes(settings.reply_inbox_prefixes.split(","))
        self.replies = ReplySubjects(self.subjects, self.inboxes, settings.max_id_bytes)
        self._handlers = handlers
        self._deliveries = ClientDeliveries(self.nc, self.counters, settings.max_buffered_bytes)
        self._owns_tracer = tracer is None
        self.tracer = tracer if tracer is not None else start_tracing(settings, "dpcoord-coordinator")
        core = Core(self.id, self.nc, self.subjects, settings, self.counters, self.spawn, self.tracer)
        # Floor 1: the owners of state. The ledger owns every request's life.
        self._kept = PeerReplies(
            self.peers.last_heard, settings.heartbeat_timeout_s, settings.max_buffered_bytes, self.counters
        )
        answers = Answers(core, self._deliveries, self.results)
        self.blocks = BlockIndex(settings.kv_index_size, settings.cache_aware_prediction_ttl_s)
        self.requests = RequestLedger(
            core,
            self.engines,
            make_policy(settings, self.blocks),
            self.control_state,
            self.peers,
            answers,
        )
        ledger = self.requests
        # Floor 2: the jobs, side by side; none imports another.
        self._relay = ReplyRelay(core, ledger, answers, self.peers, self._kept, self.replies)
        self._outbox = Outbox(core, ledger)
        self._admission = Admission(core, ledger, answers, self.engines, self.peers, self.replies)
        self._stalls = Stalls(settings.heartbeat_timeout_s / 2, self.counters)
        self._fleet = Fleet(core, ledger, self.engines, self.control_state, self._stalls)
        self._kv_feed = KvFeed(core, self.blocks, self.engines, release=ledger.release)
        self._control = Control(
            core, ledger, self.control_state, self.engines, self.peers,
            forget_engines=self._fleet.remove_all, request_stop=self.request_stop,
        )  # fmt: skip
        # The jobs across replicas and engines' weights, composed of those above.
        self._adoption = Adoption(  # once it adopted, the arbitration's claims include what it did
            core, ledger, answers, self.engines, self.peers, self._kept, self._relay, self.replies,
            lambda: self._arbitration.adopted(),
        )  # fmt: skip
        self._forwarding = Forwarding(core, self.peers, lambda: self._adoption.settling)
        self._ownership = Ownership(core, ledger, self.peers, self._admission, self._forwarding, self.replies)
        self.arbiters = Arbiters(self.id, quiet_s(settings.heartbeat_interval_s), 2 * settings.result_cache_size)
        self._arbitration = Arbitration(
            core, ledger, self.results, self.peers, self.arbiters, self._admission, self._ownership,
            lambda: self._adoption.adopting, lambda incoming, err: self._dispatch.refuse(incoming, err),
            self._admission.admit if self.tracer is None else self._admission.admit_traced,
        )  # fmt: skip
        self._replica_watch = ReplicaWatch(core, self.peers, self._kept, self._adoption, self._arbitration)
        # A stall: the silence this replica saw of its peers and engines was its own.
        self._stalls.listen(self.peers.restart_clocks, self._fleet.forgive_silence, self._arbitration.stalled)
        self._weights = WeightUpdates(core, self._control.shared, self.engines, self._drop_engine, self.reply)
        self._enrolment = Enrolment(core, ledger, self.control_state, self._control.shared, self._fleet, self._weights)
        self._tasks: set[asyncio.Task[object]] = set()
        self._stop_requested = asyncio.Event()
        self._stopped = False
        # Handler contexts (handlers/context.py) a job serves as it is: the message goes straight to it.
        self.abort = self._ownership.abort
        self.take_resubmission = self._ownership.take_resubmission
        self.abort_held = self._ownership.abort_held
        self._holds = Holds(core, ledger, self.peers)
        self.hold = self._holds.hold
        self.hold_held = self._holds.hold_held
        self.served_models = self.engines.served
        self.apply_control = self._control.apply
        self.control_engines = self._control.control_engines
        self.update_weights = self._weights.update
        self.remove_engine = self._fleet.remove
        self.take_claims = self._arbitration.take_claims
        self.admit = self._arbitration.admit
        self.kv_events = self._kv_feed.received
        self._dispatch = Dispatch(core, self, self.replies)
        self._failure_log = RateLimitedLog(log)
        self._known_clients = KnownClients()

    # ------------------------------------------------------------ state others read

    @property
    def state(self) -> CoordinatorState:
        return self.control_state.state

    @property
    def epoch(self) -> int | None:
        return self.control_state.epoch

    @property
    def shared(self) -> SharedControlState:
        """The control state shared with every replica of the prefix."""
        return self._control.shared

    @property
    def failure(self) -> str | None:
        """Why this replica stopped itself, if it did (another one serves the prefix without JetStream)."""
        return self._control.failure

    @property
    def latency(self) -> RequestLatency:
        return self.requests.latency

    @property
    def engines_changed(self) -> asyncio.Event:
        return self._fleet.changed

    @property
    def control_changed(self) -> asyncio.Event:
        """Set whenever this replica learns a newer shared control record; cleared by whoever waits."""
        return self._control.changed

    @property
    def queued(self) -> int:
        return self.requests.queued

    async def wait_for_engines(self, count: int, timeout_s: float = 10.0) -> None:
        await self._fleet.wait_for_engines(count, timeout_s)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await connect_nats(
            self.settings,
            name=f"dpcoord-coordinator-{self.id}",
            on_disconnect=self._deliveries.hold,
            on_reconnect=self._on_bus_back,
            nc=self.nc,
        )
        try:
            await self._control.open()
        except BaseException:
            await close_nats(self.nc)
            raise
        await self._dispatch.subscribe(self._handlers)
        await flush_subscriptions(self.nc)
        self.spawn(keep_running("watchdog", self._fleet.watch_once, self.counters))
        self.spawn(keep_running("replicas", self._control.watch_replicas_once, self.counters))
        self.spawn(keep_running("heartbeat", self._heartbeat_once, self.counters, self.settings.heartbeat_interval_s))
        self.spawn(keep_running("routing", self._outbox.route_once, self.counters))
        asyncio.get_running_loop().call_later(self.settings.heartbeat_timeout_s, self._warmed_up)
        self._replica_watch.start(quiet_s(self.settings.heartbeat_interval_s))
        log.info("coordinator %s serving %d subjects under %s.*", self.id, len(self._handlers), self.subjects.prefix)

    async def run_until_stopped(self) -> None:
        await self._stop_requested.wait()

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def stop(self) -> None:
        """Leave NATS, safe to call twice. While peers live (a rolling restart), what engines
        hold is left to the lowest of them, which a last heartbeat (``leaving``) makes adopt it;
        every other open request is answered with an error."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        hand_over = bool(self.peers.live()) and not self._control.fleet_shutdown and self.nc.is_connected
        if hand_over:  # no engine holds a queued request, so no peer could adopt it: route them
            await self._replica_watch.stop_arbitrating(self.settings.heartbeat_interval_s)
            await self._dispatch.stop_admitting()
            await self.requests.drained(self.settings.control_timeout_s)
            await self._outbox.sent(self.settings.control_timeout_s)
        self.control_state.state = CoordinatorState.STOPPING
        await self._control.close()
        await self._dispatch.close()
        shut = WireError(ErrorCode.NO_ENGINE, "coordinator shut down")
        for entry in [entry for entry in self.requests if not (hand_over and entry.engine_id is not None)]:
            await self.requests.fail(entry.return_path.request_id, shut)
        if hand_over:
            await self._replica_watch.leave()
            await self.nc.flush()
            log.info("coordinator %s leaves %d requests to its peers", self.id, len(self.requests))
        for task in list(self._tasks):
            task.cancel()
        if self.nc.is_connected or self.nc.is_reconnecting:
            await close_nats(self.nc)
        self._fleet.flush_log()
        if self.tracer is not None and self._owns_tracer:
            await asyncio.to_thread(self.tracer.close)  # exports what is left: off the event loop
        log.info("coordinator %s stopped", self.id)

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run ``coro`` in the background; if it fails, the failure is logged and counted."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.counters["task_errors"] += 1
            self._failure_log.exception("background task %s failed", task.get_coro(), exc=exc)

    # ------------------------------------------------------------ handler contexts (handlers/context.py)

    async def reply(self, incoming: Incoming, message: Struct) -> None:
        if incoming.reply:
            await self.nc.publish(incoming.reply, encode(message, incoming.encoding))

    async def admit_handed(self, reply: str, body: bytes) -> None:
        """A copy handed over is dispatched as its client's submission was, then arbitrated as handed."""
        await self._dispatch.dispatch_as(Header.SUBMIT_REQUEST, self._arbitration.admit_handed, reply, body)

    @property
    def settling(self) -> bool:
        return self._adoption.settling

    def client_connected(self, incoming: Incoming) -> None:
        self._known_clients.connected(incoming.owner)

    async def shut_down(self, incoming: Incoming) -> None:
        self._known_clients.check_shutdown(incoming.owner)
        written, replicas = await self._control.shut_down_all()
        await self.reply(incoming, Ack(Header.SHUTDOWN, state=self.state, revision=written.revision, replicas=replicas))
        await self.nc.flush()
        self.request_stop()

    def engine_sender(self, incoming: Incoming, claimed: str) -> str:
        return self._fleet.speaker(incoming.sender, claimed)

    def check_weight_update(self) -> None:
        self._weights.check(self.state)

    async def register_engine(
        self,
        incoming: Incoming,
        engine_id: str,
        capacity: int,
        model: str | None,
        weight_version: WeightVersion | None,
        kv_sequence: int | None,
        logprobs: bool,
    ) -> None:
        await self._enrolment.register(incoming, engine_id, capacity, model, weight_version, logprobs)
        self._kv_feed.registered(engine_id, kv_sequence)

    async def engine_heartbeat(self, heartbeat: Heartbeat, own_subjects: bool) -> None:
        await self._enrolment.heartbeat(heartbeat, own_subjects)
        self._kv_feed.heard(heartbeat)

    async def _drop_engine(self, engine_id: str, reason: str) -> None:
        """Remove an engine that could not swap in the fleet's weights. Not as one that left:
        its heartbeats bring it back once they carry the fleet's version, if it registers no sooner."""
        await self._fleet.remove(engine_id, reason, departed=False)

    async def relay_finals(self, engine_id: str, replies: list[RoutedReply]) -> None:
        self._fleet.heard_from(engine_id)
        await self._relay.relay_finals(engine_id, replies)

    async def relay_partials(self, engine_id: str, replies: list[RoutedReply]) -> None:
        self._fleet.heard_from(engine_id)
        await self._relay.relay_partials(engine_id, replies)

    def peer_seen(self, coordinator_id: str, leaving: bool = False, arbitrates: bool = False) -> None:
        if id_problem(coordinator_id, self.settings.max_id_bytes) is not None:
            raise WireError(ErrorCode.MALFORMED, f"coordinator_id {coordinator_id[:64]!r} is not a valid id")
        if leaving:
            self._replica_watch.left(coordinator_id)
        elif not self.peers.saw(coordinator_id):
            self.counters["peers_ignored"] += 1
        elif coordinator_id != self.id:
            self._arbitration.heard(coordinator_id, arbitrates)

    # ------------------------------------------------------------ background

    async def _heartbeat_once(self) -> None:
        """One beat to the other replicas, and housekeeping: expired results swept by time, idle
        owners forgotten, the block index's (:meth:`KvFeed.tick`). A beat far too late tells of a stall."""
        self.results.sweep()
        self.requests.forget_idle_owners()
        self._kv_feed.tick()
        await self._replica_watch.beat()
        await self._stalls.sleep(self.settings.heartbeat_interval_s)

    def _warmed_up(self) -> None:
        """Every live engine and peer has been heard by now: settle what waited for that."""
        self._replica_watch.warmed_up()
        self._kv_feed.warmed_up()
        self.requests.release()

    def _on_bus_back(self) -> None:
        self._replica_watch.reconnected()
        self._arbitration.reconnected()
        self._control.reconnected()
        self._fleet.forgive_silence()
        asyncio.get_running_loop().call_later(self.settings.reconnect_grace_s, self._open_deliveries)

    def _open_deliveries(self) -> None:
        if self.nc.is_connected:
            self.spawn(self._deliveries.release())
