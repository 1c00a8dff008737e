"""The engine runtime: one data-parallel rank on NATS, driving a backend.

It registers with the coordinator, heartbeats its load, runs routed requests through the
backend step by step, and sends one batched ``engine_reply_partial`` and one batched
``engine_reply`` per step. Replies are encoded for the client here, from the return path each
request carries, so the coordinator only forwards bytes. Control signals are applied and
confirmed; pause is a barrier: its confirmation waits for the step in progress. Coordinator
replicas broadcast independently, so a control signal carries the revision of the shared
control state it wrote, and one older than the last applied is confirmed without effect.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from engines.backend import Backend, GenerationRequest, TokenOutput
from service.bus.direct import DirectClient
from service.protocol.errors import ErrorCode, WireError
from service.ops.log_limit import RateLimitedLog
from service.bus.connection import close_nats, connect_nats, flush_subscriptions
from service.ops.settings import Settings
from service.protocol.subjects import CONTROL_HEADERS, RESEND_REPLIES, Header, Subjects
from service.protocol.codec import Encoding, PayloadDecoder, encode, encode_msgpack, msgpack_decoder
from service.protocol.messages import (
    EngineAck,
    EngineDisconnect,
    EngineRegister,
    EngineReplyBatch,
    EngineSignal,
    EpochSpan,
    Final,
    FinishReason,
    Heartbeat,
    Partial,
    RegisterAck,
    ResendAnswer,
    ResendReplies,
    ReturnPath,
    RoutedAbort,
    RoutedReply,
    RoutedRequest,
    RoutedRequestBatch,
    SubmitRequest,
    error_reply,
)

log = logging.getLogger(__name__)

_routed_decoder = msgpack_decoder(RoutedRequestBatch)
_abort_decoder = msgpack_decoder(RoutedAbort)
_control_decoder = msgpack_decoder(EngineSignal)
_register_ack_decoder = msgpack_decoder(RegisterAck)
_submit_decoder = PayloadDecoder(SubmitRequest)
_resend_decoder = msgpack_decoder(ResendReplies)
_BATCH_OVERHEAD = 256
# Terminal replies kept so one lost on the way (a NATS restart, say) can be sent again.
RECENT_REPLIES_KEPT = 10_000


@dataclass(slots=True, eq=False)
class ActiveRequest:
    route: ReturnPath
    encoding: Encoding
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    unsent_tokens: list[int] = field(default_factory=list)
    unsent_text: list[str] = field(default_factory=list)
    partials_sent: int = 0
    epochs: list[EpochSpan] = field(default_factory=list)

    def record(self, output: TokenOutput, epoch: int | None) -> None:
        if output.new_tokens:
            start = len(self.tokens)
            end = start + len(output.new_tokens)
            if self.epochs and self.epochs[-1].epoch == epoch:
                self.epochs[-1].end = end
            else:
                self.epochs.append(EpochSpan(epoch, start, end))
        self.tokens.extend(output.new_tokens)
        self.text.append(output.text)
        self.unsent_tokens.extend(output.new_tokens)
        self.unsent_text.append(output.text)

    def partial(self) -> RoutedReply:
        route = self.route
        message = Partial(route.request_id, route.client_request_id, self.unsent_tokens, "".join(self.unsent_text))
        self.unsent_tokens, self.unsent_text = [], []
        reply = RoutedReply(route, encode(message, self.encoding), seq=self.partials_sent)
        self.partials_sent += 1
        return reply

    def final(self, engine_id: str, finish_reason: FinishReason) -> RoutedReply:
        route = self.route
        message = Final(
            route.request_id, route.client_request_id, engine_id, self.tokens, "".join(self.text), finish_reason,
            epochs=self.epochs or None,
        )
        return RoutedReply(route, encode(message, self.encoding), seq=self.partials_sent)

    def error(self, err: WireError) -> RoutedReply:
        route = self.route
        reply = error_reply(err, route.client_request_id, route.request_id)
        return RoutedReply(route, encode(reply, self.encoding), seq=self.partials_sent)


class EngineRuntime:
    def __init__(self, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.engine_id = settings.engine_id or f"e{uuid.uuid4().hex[:12]}"
        self.subjects = Subjects(settings.subject_prefix)
        self.paused = False
        self.epoch: int | None = None
        self.control_revision = 0  # of the shared control state, as last applied
        self.counters: Counter[str] = Counter()
        self.registered = asyncio.Event()
        self._malformed_log = RateLimitedLog(log)
        self._active: dict[str, ActiveRequest] = {}
        self._recent_replies: OrderedDict[str, RoutedReply] = OrderedDict()
        self._wake = asyncio.Event()
        self._connected = asyncio.Event()
        self._connected.set()
        self._step_lock = asyncio.Lock()
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._nc: DirectClient | None = None
        self._controls: dict[str, Callable[[EngineSignal], Awaitable[str]]] = {
            Header.PAUSE: self._pause,
            Header.UNPAUSE: self._unpause,
            Header.SUSPEND: self._suspend,
            Header.RESUME: self._resume,
            Header.STOP: self._stop_serving,
            Header.SET_GENERATION_EPOCH: self._set_epoch,
            Header.START_CUDA_PROFILER: self._start_profiler,
            Header.STOP_CUDA_PROFILER: self._stop_profiler,
        }

    # ------------------------------------------------------------ lifecycle

    @property
    def nc(self) -> DirectClient:
        if self._nc is None:
            raise RuntimeError("engine is not started")
        return self._nc

    @property
    def load(self) -> int:
        return len(self._active)

    async def start(self) -> None:
        self._nc = await connect_nats(
            self.settings, name=f"dpcoord-engine-{self.engine_id}",
            on_disconnect=self._connected.clear, on_reconnect=self._on_reconnect,
        )
        # Routed messages are the hot path: handled on nats-py's reading task (service/bus/direct.py).
        await self.nc.subscribe_direct(self.subjects.engine_wildcard(self.engine_id), self._on_routed)
        await self.nc.subscribe(self.subjects.broadcast_wildcard(), cb=self._on_broadcast)
        await flush_subscriptions(self.nc)
        self._heartbeat_task = asyncio.create_task(self._heartbeat())
        self._tasks = [asyncio.create_task(self._register()), self._heartbeat_task, asyncio.create_task(self._step_loop())]
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
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._nc is not None:
            if self._nc.is_connected:
                await self.nc.publish(
                    self.subjects.coordinator(Header.DISCONNECT), encode_msgpack(EngineDisconnect(self.engine_id, reason))
                )
            await close_nats(self._nc)
        await self.backend.close()
        log.info("engine_id=%s stopped (%s)", self.engine_id, reason)

    async def __aenter__(self) -> EngineRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _register(self) -> None:
        message = encode_msgpack(
            EngineRegister(self.engine_id, self.settings.engine_capacity, self.backend.name, self.paused)
        )
        delay = 0.05
        while True:
            try:
                msg = await self.nc.request(self.subjects.coordinator(Header.REGISTER), message, timeout=2.0)
                ack = _register_ack_decoder.decode(msg.data)
                break
            except (NoRespondersError, NatsTimeoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.info("engine_id=%s: registration not answered (%s); retrying", self.engine_id, type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.paused = ack.state != "running"
        self.epoch = ack.epoch
        self.control_revision = ack.revision
        self.registered.set()
        self._wake.set()
        log.info("engine_id=%s registered with coordinator %s (state %s)", self.engine_id, ack.coordinator_id, ack.state)

    async def _heartbeat(self) -> None:
        """Beats only once registered: an early beat would make the coordinator adopt, then
        re-register, this engine. After that, beats let a restarted coordinator adopt it."""
        subject = self.subjects.coordinator(Header.HEARTBEAT)
        await self.registered.wait()
        while True:
            if self._connected.is_set():
                beat = Heartbeat(self.engine_id, self.load, self.settings.engine_capacity, list(self._active))
                await self.nc.publish(subject, encode_msgpack(beat))
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    # ------------------------------------------------------------ requests

    async def _on_routed(self, subject: str, reply: str, data: bytes) -> None:
        """A direct handler: it publishes, and never waits for another message."""
        header = self.subjects.header_of(subject)
        try:
            if header == Header.SUBMIT_REQUEST:
                for routed in _routed_decoder.decode(data).requests:
                    await self._on_submit(routed)
            elif header == Header.ABORT_REQUEST:
                await self._on_abort(_abort_decoder.decode(data))
            elif header == RESEND_REPLIES:
                await self._on_resend(_resend_decoder.decode(data), reply)
            else:
                raise WireError(ErrorCode.NOT_FOUND, f"no routed message {header!r}")
        except (msgspec.DecodeError, msgspec.ValidationError, WireError) as exc:
            self.counters["malformed"] += 1
            self._malformed_log.warning("engine_id=%s dropped %s message (%d bytes): %s", self.engine_id, header, len(data), exc)

    async def _on_submit(self, routed: RoutedRequest) -> None:
        route = routed.route
        try:
            encoding = Encoding(route.encoding)
        except ValueError:
            self.counters["malformed"] += 1
            self._malformed_log.warning("engine_id=%s request_id=%s: unknown encoding %r; dropped", self.engine_id, route.request_id, route.encoding)
            return
        if route.request_id in self._active:
            log.warning("engine_id=%s request_id=%s routed twice; ignored", self.engine_id, route.request_id)
            return
        active = ActiveRequest(route, encoding)
        try:
            submit = _submit_decoder.decode(routed.body, encoding)
            self.backend.add(GenerationRequest.from_submit(route.request_id, submit))
        except WireError as err:
            log.info("engine_id=%s request_id=%s refused: %s", self.engine_id, route.request_id, err)
            await self._publish(Header.ENGINE_REPLY, [active.error(err)])
            return
        self._active[route.request_id] = active
        self._wake.set()

    async def _on_abort(self, abort: RoutedAbort) -> None:
        active = self._active.pop(abort.request_id, None)
        if active is None:
            return
        self.backend.abort(abort.request_id)
        await self._publish(Header.ENGINE_REPLY, [active.final(self.engine_id, "abort")])

    def _on_reconnect(self) -> None:
        self._connected.set()
        self._wake.set()

    async def _on_resend(self, resend: ResendReplies, reply_subject: str) -> None:
        again = [reply for request_id in resend.request_ids if (reply := self._recent_replies.get(request_id))]
        unknown = [
            request_id for request_id in resend.request_ids
            if request_id not in self._recent_replies and request_id not in self._active
        ]
        log.info("engine_id=%s: sending %d replies again; %d requests never arrived", self.engine_id, len(again), len(unknown))
        await self._publish(Header.ENGINE_REPLY, again, remember=False)
        if reply_subject:
            await self.nc.publish(reply_subject, encode_msgpack(ResendAnswer(unknown)))

    async def _step_loop(self) -> None:
        """Steps while there is work, the fleet is not paused and NATS is reachable: tokens
        generated with nowhere to send them would only fill the outbound buffer."""
        while True:
            await self._wake.wait()
            if self.paused or not self.backend.has_work() or not self._connected.is_set():
                self._wake.clear()
                continue
            try:
                async with self._step_lock:
                    if self.paused:  # a pause confirmed while this step waited for the lock
                        continue
                    outputs = await self.backend.step()
            except Exception as exc:
                log.exception("engine_id=%s: step failed; failing its %d requests", self.engine_id, len(self._active))
                await self._fail_all(WireError(ErrorCode.INTERNAL, f"engine {self.engine_id} step failed: {exc}"))
            else:
                await self._publish_outputs(outputs)
            # Between steps, let the reader and nats-py's flusher run: a backend's step need not
            # yield, and yielding after publishing sends this step's replies a loop turn sooner.
            await asyncio.sleep(0)

    async def _fail_all(self, err: WireError) -> list[ActiveRequest]:
        failed = list(self._active.values())
        self._active.clear()
        for active in failed:
            self.backend.abort(active.route.request_id)
        await self._publish(Header.ENGINE_REPLY, [active.error(err) for active in failed])
        return failed

    async def _publish_outputs(self, outputs: list[TokenOutput]) -> None:
        interval = self.settings.stream_interval
        partials: list[RoutedReply] = []
        finals: list[RoutedReply] = []
        for output in outputs:
            active = self._active.get(output.request_id)
            if active is None:
                continue
            active.record(output, self.epoch)
            if output.finish_reason is not None:
                del self._active[output.request_id]
                if active.route.stream and active.unsent_tokens:
                    partials.append(active.partial())
                finals.append(active.final(self.engine_id, output.finish_reason))
            elif active.route.stream and len(active.unsent_tokens) >= interval:
                partials.append(active.partial())
        await self._publish(Header.ENGINE_REPLY_PARTIAL, partials)
        await self._publish(Header.ENGINE_REPLY, finals)

    async def _publish(self, header: Header, replies: list[RoutedReply], remember: bool = True) -> None:
        """Send replies in as few messages as the server's max_payload allows; terminal ones are
        remembered for a while, in case the coordinator asks for them again."""
        subject = self.subjects.coordinator(header)
        if remember and header == Header.ENGINE_REPLY:
            recent = self._recent_replies
            for reply in replies:
                recent[reply.route.request_id] = reply
            while len(recent) > RECENT_REPLIES_KEPT:
                recent.popitem(last=False)
        limit = self.nc.max_payload - _BATCH_OVERHEAD
        batch: list[RoutedReply] = []
        size = 0
        for reply in replies:
            reply_size = len(reply.body) + len(reply.route.reply_to) + 64
            if reply_size > limit:
                reply = self._too_large(reply)
                reply_size = len(reply.body) + len(reply.route.reply_to) + 64
            if batch and size + reply_size > limit:
                await self._send_batch(subject, batch)
                batch, size = [], 0
            batch.append(reply)
            size += reply_size
        if batch:
            await self._send_batch(subject, batch)

    async def _send_batch(self, subject: str, batch: list[RoutedReply]) -> None:
        """A batch NATS cannot take now is lost, not fatal: the coordinator's deadline answers it."""
        try:
            await self.nc.publish(subject, encode_msgpack(EngineReplyBatch(self.engine_id, batch)))
        except NatsError as exc:
            self.counters["replies_lost"] += len(batch)
            log.warning("engine_id=%s: %d replies lost: %s", self.engine_id, len(batch), exc)

    def _too_large(self, reply: RoutedReply) -> RoutedReply:
        route = reply.route
        err = WireError(ErrorCode.TOO_LARGE, f"reply of {len(reply.body)} bytes exceeds NATS max_payload {self.nc.max_payload}")
        body = encode(error_reply(err, route.client_request_id, route.request_id), Encoding(route.encoding))
        return RoutedReply(route, body, reply.seq)

    # ------------------------------------------------------------ control

    async def _on_broadcast(self, msg: Msg) -> None:
        header = self.subjects.header_of(msg.subject)
        control = self._controls.get(header)
        if control is None:
            self.counters["malformed"] += 1
            self._malformed_log.warning("engine_id=%s: unknown broadcast %s", self.engine_id, header)
            return
        try:
            signal = _control_decoder.decode(msg.data)
            ack = EngineAck(self.engine_id, header, True, await self._apply_control(header, control, signal))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.counters["malformed"] += 1
            ack = EngineAck(self.engine_id, header, False, f"undecodable signal: {exc}")
        except Exception as exc:
            log.exception("engine_id=%s: %s failed", self.engine_id, header)
            ack = EngineAck(self.engine_id, header, False, f"{type(exc).__name__}: {exc}")
        if msg.reply:
            await self.nc.publish(msg.reply, encode_msgpack(ack))
        if header == Header.STOP and ack.ok:
            self.request_stop()

    async def _apply_control(
        self, header: str, control: Callable[[EngineSignal], Awaitable[str]], signal: EngineSignal
    ) -> str:
        """Broadcasts are handled one at a time, in arrival order. A state signal with a
        revision applies only when newer than the last applied, and brings its record's epoch."""
        if signal.revision is not None and header in CONTROL_HEADERS:
            if signal.revision <= self.control_revision:
                self.counters["superseded_signals"] += 1
                return f"superseded by revision {self.control_revision}"
            self.control_revision = signal.revision
            self.epoch = signal.epoch
        return await control(signal)

    async def _pause(self, signal: EngineSignal) -> str:
        async with self._step_lock:
            self.paused = True
        return ""

    async def _unpause(self, signal: EngineSignal) -> str:
        self.paused = False
        self._wake.set()
        return ""

    async def _suspend(self, signal: EngineSignal) -> str:
        async with self._step_lock:
            self.paused = True
            await self.backend.suspend()
        return ""

    async def _resume(self, signal: EngineSignal) -> str:
        await self.backend.resume()
        return ""

    async def _stop_serving(self, signal: EngineSignal) -> str:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        async with self._step_lock:
            self.paused = True
            failed = await self._fail_all(WireError(ErrorCode.NO_ENGINE, f"engine {self.engine_id} stopped by control signal"))
        return f"{len(failed)} requests failed"

    async def _set_epoch(self, signal: EngineSignal) -> str:
        self.epoch = signal.epoch
        return ""

    async def _start_profiler(self, signal: EngineSignal) -> str:
        return self.backend.start_profiler()

    async def _stop_profiler(self, signal: EngineSignal) -> str:
        return self.backend.stop_profiler()
