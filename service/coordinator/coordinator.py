"""The coordinator: one NATS subscription per registered header, and the request bookkeeping
that the handlers drive.

Every handler call is guarded: a message that fails to decode or that a handler refuses
becomes an error reply (when the sender gave somewhere to reply), a log line and a counter.
Every accepted request leaves through exactly one terminal reply: its final, or an error
from whoever pops it from the request table first (engine reply, deadline, engine loss,
abort, shutdown).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass

import msgspec
from msgspec import Struct
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from handlers.registry import HandlerRegistry, HandlerSpec
from service.coordinator.deliveries import ClientDeliveries
from service.coordinator.broadcast import BroadcastResult, broadcast
from service.bus.direct import DirectClient, DirectSubscription
from service.coordinator.fleet_log import FleetLog
from service.coordinator.pool import EnginePool, EngineRecord
from service.protocol.errors import ErrorCode, WireError
from service.ops.latency import RequestLatency
from service.ops.log_limit import RateLimitedLog
from service.bus.connection import close_nats, connect_nats, flush_subscriptions
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.requests import ClientKey, InflightRequest, RequestTable
from service.coordinator.results import ResultCache
from service.coordinator.routing import make_policy
from service.ops.settings import Settings
from service.protocol.state import CoordinatorState
from service.protocol.subjects import FANOUT_HEADERS, RESEND_REPLIES, Header, Subjects
from service.coordinator.timers import CoarseTimers
from service.protocol.codec import Encoding, detect_encoding, encode, encode_msgpack, msgpack_decoder, return_hints
from service.protocol.messages import (
    ControlSignal,
    CoordinatorHeartbeat,
    Final,
    ReturnPath,
    RoutedAbort,
    ResendAnswer,
    ResendReplies,
    RoutedReply,
    RoutedRequest,
    RoutedRequestBatch,
    SubmitEnvelope,
    SubmitRequest,
    error_reply,
)

log = logging.getLogger(__name__)

# How long a final that overtook one of its partials waits for it before going out anyway.
PARKED_FINAL_WAIT_S = 1.0
_resend_answer_decoder = msgpack_decoder(ResendAnswer)

# Most orphan replies buffered while a new replica learns which peers are alive.
MAX_BUFFERED_ORPHANS = 10_000

# The hot path, and what every engine sends (a fleet of thousands heartbeats thousands of
# times a second), handled on nats-py's reading task (service/bus/direct.py). Their handlers
# must never wait for another NATS message; publishing is fine.
DIRECT_HEADERS: frozenset[str] = frozenset({
    Header.SUBMIT_REQUEST, Header.ENGINE_REPLY, Header.ENGINE_REPLY_PARTIAL,
    Header.REGISTER, Header.HEARTBEAT, Header.DISCONNECT,
})

# Bytes a routed request adds to its body and the variable strings of its return path (the
# ids, encoding and msgpack framing), and bytes of framing per batch: generous bounds that
# split batches below the server's max_payload.
_ROUTE_OVERHEAD = 160
_BATCH_OVERHEAD = 64


@dataclass(slots=True)  # not frozen: a frozen dataclass costs 0.6 us more to build, once per message
class Sender:
    """Where a message came from and how to answer it."""

    header: str
    reply: str | None
    encoding: Encoding
    body: bytes


class Coordinator:
    def __init__(self, settings: Settings, handlers: HandlerRegistry) -> None:
        self.settings = settings
        self.id = settings.coordinator_id or f"c{uuid.uuid4().hex[:12]}"
        self.subjects = Subjects(settings.subject_prefix)
        self.state = CoordinatorState.RUNNING
        self.epoch: int | None = None
        self.engines = EnginePool(settings.max_inflight_per_engine, departed_memory_s=2 * settings.heartbeat_timeout_s)
        self.requests = RequestTable()
        self.results = ResultCache(settings.result_ttl_s, settings.result_cache_size)
        self.peers = CoordinatorPeers(self.id, settings.heartbeat_timeout_s)
        self.counters: Counter[str] = Counter()
        self.latency = RequestLatency()
        self.engines_changed = asyncio.Event()
        self._handlers = handlers
        self._policy = make_policy(settings, self.engines)
        self._fleet_log = FleetLog(log)
        self._held: deque[InflightRequest] = deque()
        self._deadlines = CoarseTimers()
        self._outbox: dict[str, list[InflightRequest]] = {}
        self._outbox_ready = asyncio.Event()
        self._sequence = itertools.count()
        self._subscriptions: list[Subscription | DirectSubscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self._nc: DirectClient | None = None
        self._max_body = settings.max_payload_bytes
        self._refusal_log = RateLimitedLog(log)
        self._deliveries: ClientDeliveries | None = None
        self._orphans: list[tuple[RoutedReply, bool]] = []

    # ------------------------------------------------------------ lifecycle

    @property
    def nc(self) -> DirectClient:
        if self._nc is None:
            raise RuntimeError("coordinator is not started")
        return self._nc

    @property
    def deliveries(self) -> ClientDeliveries:
        if self._deliveries is None:
            raise RuntimeError("coordinator is not started")
        return self._deliveries

    async def start(self) -> None:
        self._nc = await connect_nats(
            self.settings, name=f"dpcoord-coordinator-{self.id}",
            on_disconnect=self._on_bus_down, on_reconnect=self._on_bus_back,
        )
        self._deliveries = ClientDeliveries(self._nc)
        if self.nc.max_payload < self._max_body:
            self._max_body = self.nc.max_payload
        for header, spec in self._handlers.items():
            queue = "" if header in FANOUT_HEADERS else self.settings.queue_group
            subject = self.subjects.coordinator(header)
            if header in DIRECT_HEADERS:
                subscription = await self.nc.subscribe_direct(subject, functools.partial(self._dispatch, spec), queue=queue)
            else:
                subscription = await self.nc.subscribe(subject, queue=queue, cb=self._callback(spec))
            self._subscriptions.append(subscription)
        await flush_subscriptions(self.nc)
        self.spawn(self._watch_heartbeats())
        self.spawn(self._heartbeat())
        self.spawn(self._route_outbox())
        asyncio.get_running_loop().call_later(self.settings.heartbeat_timeout_s, self._warmed_up)
        log.info("coordinator %s serving %d subjects under %s.*", self.id, len(self._handlers), self.subjects.prefix)

    async def run_until_stopped(self) -> None:
        await self._stop_requested.wait()

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def stop(self) -> None:
        """Answer every open request with an error, then leave NATS. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        self.state = CoordinatorState.STOPPING
        for sub in self._subscriptions:
            await sub.unsubscribe()
        for entry in self.requests:
            await self.fail(entry.route.request_id, WireError(ErrorCode.NO_ENGINE, "coordinator shut down"))
        for task in list(self._tasks):
            task.cancel()
        if self._nc is not None:
            await close_nats(self._nc)
        log.info("coordinator %s stopped", self.id)

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ dispatch

    def _callback(self, spec: HandlerSpec):  # noqa: ANN202 - nats-py callback
        async def on_message(msg: Msg) -> None:
            await self._dispatch(spec, msg.subject, msg.reply, msg.data)

        return on_message

    async def _dispatch(self, spec: HandlerSpec, subject: str, reply: str, body: bytes) -> None:
        """Decode, run the handler, answer any failure; ``subject`` is ``spec``'s own, unused."""
        if reply and (problem := self.subjects.reply_problem(reply)):
            self.counters["unsafe_reply_subject"] += 1
            self._refusal_log.warning("dropped %s (%d bytes): reply subject %r %s", spec.header, len(body), reply, problem)
            return
        encoding = detect_encoding(body)
        sender = Sender(spec.header, reply or None, encoding, body)
        try:
            if len(body) > self._max_body:
                raise WireError(ErrorCode.TOO_LARGE, f"{len(body)} bytes exceeds the {self._max_body}-byte payload limit")
            payload = spec.decoder.decode(body, encoding)
            if await spec.fn(self, sender, payload):
                self.request_stop()
        except WireError as err:
            await self._refuse(sender, err)
        except Exception:
            log.exception("handler for %s failed", spec.header)
            await self._refuse(sender, WireError(ErrorCode.INTERNAL, f"internal error handling {spec.header}"))

    async def _refuse(self, sender: Sender, err: WireError) -> None:
        self.counters[f"error_{err.code}"] += 1
        hints = return_hints(sender.body, sender.encoding)
        usable = isinstance(hints.reply_to, str) and self.subjects.reply_problem(hints.reply_to) is None
        reply_to = hints.reply_to if usable else sender.reply
        client_request_id = hints.client_request_id if isinstance(hints.client_request_id, (str, int)) else None
        self._refusal_log.warning(
            "refused %s (%d bytes, client_request_id=%s): %s %s",
            sender.header, len(sender.body), client_request_id, err.code, err.message,
        )
        if not reply_to:
            return
        await self.nc.publish(reply_to, encode(error_reply(err, client_request_id), sender.encoding))
        if hints.stream is True:
            await self.nc.publish(reply_to, b"")

    async def reply(self, sender: Sender, message: Struct) -> None:
        if sender.reply:
            await self.nc.publish(sender.reply, encode(message, sender.encoding))

    # ------------------------------------------------------------ requests

    async def admit(self, sender: Sender, submit: SubmitRequest | SubmitEnvelope) -> None:
        """Route or hold a submission. An envelope's body is forwarded undecoded (the engine validates it)."""
        if submit.reply_to is not None and (problem := self.subjects.reply_problem(submit.reply_to)):
            raise WireError(ErrorCode.MALFORMED, f"reply_to {submit.reply_to!r} {problem}")
        reply_to = submit.reply_to or sender.reply
        if reply_to is None:
            self.counters["submit_without_reply"] += 1
            log.warning("submission without reply subject dropped (client_request_id=%s)", submit.client_request_id)
            return
        if isinstance(submit, SubmitEnvelope):
            body, encoding, timeout_s = submit.body, detect_encoding(submit.body), submit.timeout_s
        else:
            body, encoding, timeout_s = sender.body, sender.encoding, submit.sampling_params.timeout_s
        client_key = None
        if submit.client_request_id is not None:
            client_key = (submit.client_id, submit.client_request_id)
            if await self._resubmitted(client_key, reply_to, submit.stream):
                return
        running = self.state is CoordinatorState.RUNNING
        if running and len(self.engines) == 0 and self.peers.warmed_up:
            # A replica just started holds instead: heartbeats are about to introduce the fleet.
            raise WireError(ErrorCode.NO_ENGINE, "no engine available")
        key = self._policy.key_of(submit)
        engine = self._policy.choose(key) if running else None
        if engine is None and len(self._held) >= self.settings.max_queued_requests:
            raise WireError(ErrorCode.OVERLOADED, f"coordinator queue full ({self.settings.max_queued_requests} held)")

        request_id = f"{self.id}-{next(self._sequence)}"
        route = ReturnPath(request_id, self.id, reply_to, encoding.value, submit.stream, submit.client_request_id, submit.client_id)
        entry = InflightRequest(route, encoding, body, client_key, routing_key=key)
        entry.deadline = self._deadlines.call_later(timeout_s or self.settings.request_timeout_s, self._expire, request_id)
        self.requests.add(entry)
        self.counters["submitted"] += 1
        if engine is None:
            self._held.append(entry)
        else:
            self._send(entry, engine)

    async def _resubmitted(self, client_key: ClientKey, reply_to: str, stream: bool) -> bool:
        """A named client's repeated (client_id, client_request_id) is answered, never run twice:
        a cached result is sent again, a request in flight now answers the new reply subject.
        Anonymous clients share one namespace, so for them a repeat in flight is refused."""
        existing = self.requests.find_client(client_key)
        if client_key[0] is None:
            if existing is not None:
                raise WireError(ErrorCode.CONFLICT, f"client_request_id {client_key[1]!r} is already in flight")
            return False
        if existing is not None:
            existing.route = msgspec.structs.replace(existing.route, reply_to=reply_to, stream=stream)
            self.counters["resubmitted"] += 1
            return True
        if self.deliveries.repoint(client_key, reply_to):
            self.counters["resubmitted"] += 1
            return True
        cached = self.results.get(client_key)
        if cached is None:
            return False
        self.counters["replayed"] += 1
        await self.deliveries.publish(reply_to, cached.body, client_key)
        if stream:
            await self.deliveries.publish(reply_to, b"", client_key)
        return True

    def _send(self, entry: InflightRequest, engine: EngineRecord) -> None:
        """Assign ``entry`` to ``engine``; it leaves with the engine's batch at the end of this loop turn."""
        entry.engine_id = engine.engine_id
        entry.attempts += 1
        entry.routed_at = time.monotonic()
        self.engines.assign(engine, entry.route.request_id)
        batch = self._outbox.get(engine.engine_id)
        if batch is None:
            self._outbox[engine.engine_id] = [entry]
            self._outbox_ready.set()
        else:
            batch.append(entry)

    async def _route_outbox(self) -> None:
        """Publish each engine's routed requests as one message per loop turn rather than one each.

        Requests are picked up after the message callbacks of this turn ran, so under load a
        batch holds everything that arrived in one read from the socket."""
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            outbox, self._outbox = self._outbox, {}
            self._policy.turn_ended()
            for engine_id, entries in outbox.items():
                try:
                    await self._publish_routed(engine_id, entries)
                except Exception:
                    log.exception("engine_id=%s: routing %d requests failed", engine_id, len(entries))

    async def _publish_routed(self, engine_id: str, entries: list[InflightRequest]) -> None:
        subject = self.subjects.engine(engine_id, Header.SUBMIT_REQUEST)
        limit = self.nc.max_payload - _BATCH_OVERHEAD
        batch: list[RoutedRequest] = []
        size = 0
        for entry in entries:
            route = entry.route
            if entry.engine_id != engine_id or route.request_id not in self.requests:
                continue  # answered or routed elsewhere while it waited for this turn
            entry_size = (
                len(entry.body) + len(route.reply_to) + len(str(route.client_request_id)) + len(route.client_id or "")
                + _ROUTE_OVERHEAD
            )
            if entry_size > limit:
                await self.fail(route.request_id, WireError(
                    ErrorCode.TOO_LARGE, f"request of {len(entry.body)} bytes does not fit NATS max_payload {self.nc.max_payload} once routed"))
                continue
            if batch and size + entry_size > limit:
                await self._publish_batch(subject, batch)
                batch, size = [], 0
            batch.append(RoutedRequest(route, entry.body))
            size += entry_size
        if batch:
            await self._publish_batch(subject, batch)

    async def _publish_batch(self, subject: str, batch: list[RoutedRequest]) -> None:
        try:
            await self.nc.publish(subject, encode_msgpack(RoutedRequestBatch(batch)))
            self.counters["routed_messages"] += 1
            self.counters["routed_requests"] += len(batch)
        except Exception as exc:  # the routing task must outlive any one failed publish
            log.warning("routing %d requests on %s failed: %s", len(batch), subject, exc)
            for routed in batch:
                await self.fail(routed.route.request_id, WireError(ErrorCode.NO_ENGINE, f"could not route to engine: {exc}"))

    async def dispatch_held(self) -> None:
        """Route held requests while the coordinator runs and some engine has room."""
        while self._held and self.state is CoordinatorState.RUNNING:
            entry = self._held[0]
            if entry.route.request_id not in self.requests:
                self._held.popleft()
                continue
            if len(self.engines) == 0:
                if not self.peers.warmed_up:
                    return  # heartbeats are about to introduce the fleet
                self._held.popleft()
                await self.fail(entry.route.request_id, WireError(ErrorCode.NO_ENGINE, "no engine available"))
                continue
            engine = self._policy.choose(entry.routing_key)
            if engine is None:
                return
            self._held.popleft()
            self._send(entry, engine)

    def take(self, request_id: str) -> InflightRequest | None:
        """Pop a request for its terminal reply and free its engine slot."""
        entry = self.requests.pop(request_id)
        if entry is None:
            return None
        self.latency.observe_finished(entry.admitted_at)
        if entry.engine_id is not None:
            engine = self.engines.get(entry.engine_id)
            if engine is not None:
                self.engines.release(engine, request_id)
        return entry

    async def deliver(self, route: ReturnPath, body: bytes, terminal: bool) -> None:
        """Send a reply along ``route``: this replica's own (its reply subject was checked on
        admission), or an orphan's that ``_on_orphan`` checked, since an engine wrote it."""
        client_key = None
        if route.client_id is not None and route.client_request_id is not None:
            client_key = (route.client_id, route.client_request_id)
        await self.deliveries.publish(route.reply_to, body, client_key)
        if terminal:
            self.counters["completed"] += 1
            if client_key is not None:
                self.results.put(client_key, body)
            if route.stream:
                await self.deliveries.publish(route.reply_to, b"", client_key)

    async def on_final(self, engine_id: str, reply: RoutedReply) -> None:
        request_id = reply.route.request_id
        entry = self.requests.get(request_id)
        if entry is None:
            await self._on_orphan(reply, terminal=True)
            return
        if entry.engine_id != engine_id:
            self.counters["stale_engine_replies"] += 1
            return
        if reply.seq > entry.partials_delivered:
            entry.parked_final = reply
            asyncio.get_running_loop().call_later(PARKED_FINAL_WAIT_S, self._release_parked, request_id)
            return
        self.take(request_id)
        await self.deliver(entry.route, reply.body, terminal=True)

    async def on_partial(self, engine_id: str, reply: RoutedReply) -> None:
        entry = self.requests.get(reply.route.request_id)
        if entry is None:
            await self._on_orphan(reply, terminal=False)
            return
        if entry.engine_id != engine_id:
            self.counters["stale_engine_replies"] += 1
            return
        if not entry.streamed:
            self.latency.observe_first_token(entry.admitted_at)
        entry.streamed = True
        await self.deliver(entry.route, reply.body, terminal=False)
        entry.partials_delivered += 1
        parked = entry.parked_final
        if parked is not None and parked.seq <= entry.partials_delivered:
            self.take(reply.route.request_id)
            await self.deliver(entry.route, parked.body, terminal=True)

    def _release_parked(self, request_id: str) -> None:
        entry = self.requests.get(request_id)
        if entry is not None and entry.parked_final is not None:
            self.counters["partials_lost"] += 1
            self.take(request_id)
            self.spawn(self.deliver(entry.route, entry.parked_final.body, terminal=True))

    async def _on_orphan(self, reply: RoutedReply, terminal: bool) -> None:
        """A reply for a request this replica does not hold: its own late reply, another live
        replica's (ignored), or one whose coordinator is gone (delivered by one survivor)."""
        route = reply.route
        if route.coordinator_id == self.id:
            if terminal:
                self.counters["late_replies"] += 1
                log.info("request_id=%s: engine reply after the request ended", route.request_id)
            return
        if not self.peers.warmed_up:
            if len(self._orphans) < MAX_BUFFERED_ORPHANS:
                self._orphans.append((reply, terminal))
            return
        if not self.peers.should_adopt(route.coordinator_id):
            return
        if (problem := self.subjects.reply_problem(route.reply_to)) is not None:
            # admit() refuses such a reply_to, so only an engine that rewrote the route gets here.
            self.counters["unsafe_reply_subject"] += 1
            self._refusal_log.warning(
                "request_id=%s: not delivering to reply subject %r, which %s", route.request_id, route.reply_to, problem
            )
            return
        self.counters["orphans_delivered"] += 1
        await self.deliver(route, reply.body, terminal)

    def _warmed_up(self) -> None:
        """Every live engine and peer has been heard by now: settle what waited for that."""
        orphans, self._orphans = self._orphans, []

        async def settle() -> None:
            for reply, terminal in orphans:
                await self._on_orphan(reply, terminal)
            await self.dispatch_held()

        self.spawn(settle())

    async def fail(self, request_id: str, err: WireError) -> bool:
        """Answer an open request with ``err``; False when it was already answered.

        A final parked behind a lost partial is the better answer, so it goes out instead."""
        entry = self.take(request_id)
        if entry is None:
            return False
        if entry.parked_final is not None:
            await self.deliver(entry.route, entry.parked_final.body, terminal=True)
            return True
        self.counters[f"failed_{err.code}"] += 1
        log.info("request_id=%s engine_id=%s failed: %s", request_id, entry.engine_id, err)
        reply = error_reply(err, entry.route.client_request_id, request_id)
        await self.deliver(entry.route, encode(reply, entry.encoding), terminal=True)
        if entry.engine_id is not None:
            await self._tell_engine_abort(entry.engine_id, request_id)
        await self.dispatch_held()
        return True

    async def abort(self, entry: InflightRequest) -> None:
        """Held requests end here; routed ones are aborted by their engine, which replies."""
        if entry.engine_id is not None:
            await self._tell_engine_abort(entry.engine_id, entry.route.request_id)
            return
        if self.take(entry.route.request_id) is None:
            return
        final = Final(entry.route.request_id, entry.route.client_request_id, None, [], "", "abort")
        await self.deliver(entry.route, encode(final, entry.encoding), terminal=True)

    async def _tell_engine_abort(self, engine_id: str, request_id: str) -> None:
        subject = self.subjects.engine(engine_id, Header.ABORT_REQUEST)
        await self.nc.publish(subject, encode_msgpack(RoutedAbort(request_id)))

    def _expire(self, request_id: str) -> None:
        entry = self.requests.get(request_id)
        if entry is None:
            return
        entry.deadline = None
        self.spawn(self.fail(request_id, WireError(ErrorCode.TIMED_OUT, "request deadline passed")))

    # ------------------------------------------------------------ engines

    def add_engine(self, engine_id: str, capacity: int) -> EngineRecord:
        record = self.engines.add(engine_id, capacity)
        self.engines_changed.set()
        self._fleet_log.joined(engine_id, record.capacity, len(self.engines))
        return record

    async def remove_engine(self, engine_id: str, reason: str, departed: bool = True) -> None:
        """Drop an engine; requests it had not streamed are routed again, the rest fail."""
        record = self.engines.remove(engine_id, departed)
        if record is None:
            return
        self.engines_changed.set()
        self._fleet_log.removed(engine_id, reason, record.load, len(self.engines))
        for request_id in record.requests:
            entry = self.requests.get(request_id)
            if entry is None:
                continue
            if not entry.streamed and entry.attempts <= self.settings.max_retries:
                entry.engine_id = None
                self._held.appendleft(entry)
                self.counters["retried"] += 1
            else:
                await self.fail(request_id, WireError(ErrorCode.NO_ENGINE, f"engine {engine_id} lost ({reason})"))
        await self.dispatch_held()

    async def _watch_heartbeats(self) -> None:
        """Engines silent past the timeout are removed, except while this coordinator's own
        connection is down: then their silence is ours."""
        timeout = self.settings.heartbeat_timeout_s
        while True:
            await asyncio.sleep(timeout / 4)
            if not self.nc.is_connected:
                continue
            for record in self.engines.silent_since(time.monotonic() - timeout):
                await self.remove_engine(record.engine_id, f"no heartbeat for {timeout:g} s", departed=False)

    async def _heartbeat(self) -> None:
        subject = self.subjects.coordinator(Header.COORDINATOR_HEARTBEAT)
        beat = encode_msgpack(CoordinatorHeartbeat(self.id))
        while True:
            if self.nc.is_connected:
                await self.nc.publish(subject, beat)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def _on_bus_down(self) -> None:
        self.deliveries.hold()

    def _on_bus_back(self) -> None:
        self.engines.heard_all()
        asyncio.get_running_loop().call_later(self.settings.reconnect_grace_s, self._open_deliveries)

    def _open_deliveries(self) -> None:
        if self.nc.is_connected:
            self.spawn(self.deliveries.release())

    async def reconcile(self, record: EngineRecord, active: set[str]) -> None:
        """Requests routed to an engine a while ago that it no longer holds: their submission or
        their reply was lost (a NATS restart, say). Ask the engine to send its replies again;
        what it never received is routed again (or fails, if part of it was streamed)."""
        settled_before = time.monotonic() - 2 * self.settings.heartbeat_interval_s
        missing = [
            request_id for request_id in record.requests
            if request_id not in active and (entry := self.requests.get(request_id)) is not None
            and entry.routed_at < settled_before
        ]
        if not missing:
            return
        subject = self.subjects.engine(record.engine_id, RESEND_REPLIES)
        record.reconciling = True
        try:
            msg = await self.nc.request(subject, encode_msgpack(ResendReplies(missing)), timeout=self.settings.control_timeout_s)
            unknown = _resend_answer_decoder.decode(msg.data).unknown
        except (NatsError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("engine_id=%s: resend of %d replies not answered: %s", record.engine_id, len(missing), exc)
            return
        finally:
            record.reconciling = False
        self.counters["replies_resent"] += len(missing) - len(unknown)
        for request_id in unknown:
            entry = self.requests.get(request_id)
            if entry is None or entry.engine_id != record.engine_id:
                continue
            self.engines.release(record, request_id)
            if entry.streamed:
                await self.fail(request_id, WireError(ErrorCode.NO_ENGINE, f"engine {record.engine_id} lost the request"))
                continue
            self.counters["redispatched"] += 1
            entry.engine_id = None
            self._held.appendleft(entry)
        await self.dispatch_held()

    async def wait_for_engines(self, count: int, timeout_s: float = 10.0) -> None:
        async def reached() -> None:
            while len(self.engines) < count:
                self.engines_changed.clear()
                await self.engines_changed.wait()

        await asyncio.wait_for(reached(), timeout_s)

    # ------------------------------------------------------------ control

    async def broadcast(self, signal: Header, payload: ControlSignal) -> BroadcastResult:
        expected = {record.engine_id for record in self.engines}
        return await broadcast(
            self.nc, self.subjects.broadcast(signal), encode_msgpack(payload), expected, self.settings.control_timeout_s
        )

    async def finish_stop(self) -> None:
        """After ``stop`` every engine is gone: forget them and serve new ones."""
        for record in list(self.engines):
            await self.remove_engine(record.engine_id, "stopped")
        self.state = CoordinatorState.RUNNING
