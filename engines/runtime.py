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

A routed request this engine cannot serve (undecodable, over the limits on stop strings or
``max_tokens``, refused by the backend, or failing in any other way) gets its own error reply;
the requests routed with it in the same message are not affected. The heartbeat and step
loops never die (:mod:`service.ops.loops`), and registration retries whatever goes wrong.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from engines.backend import Backend, GenerationRequest, TokenOutput
from engines.handlers import ENGINE_HANDLERS, EngineContext
from engines.limits import check_limits, check_resume
from engines.replies import ActiveRequest, ReplyPublisher
from engines.weight_updates import EngineWeights
from service.bus.connection import close_nats, connect_nats, flush_subscriptions
from service.bus.direct import DirectClient
from service.bus.registry import HandlerSpec, Incoming
from service.ops.log_limit import RateLimitedLog
from service.ops.loops import keep_running
from service.ops.settings import Settings
from service.protocol.codec import Encoding, PayloadDecoder, detect_encoding, encode_msgpack, msgpack_decoder
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import Adoption
from service.protocol.membership import (
    EngineDisconnect,
    EngineRegister,
    Heartbeat,
    RegisterAck,
    ResendAnswer,
    ResendReplies,
)
from service.protocol.messages import (
    EngineAck,
    EngineSignal,
    ErrorReply,
    PauseMode,
    RoutedReply,
    RoutedRequest,
    SubmitRequest,
    WeightSignal,
)
from service.protocol.subjects import CONTROL_HEADERS, Header, Subjects

log = logging.getLogger(__name__)

_register_ack_decoder = msgpack_decoder(RegisterAck)
_register_error_decoder = msgpack_decoder(ErrorReply)
_signal_decoder = msgpack_decoder(EngineSignal)
_submit_decoder = PayloadDecoder(SubmitRequest)


class EngineRuntime:
    def __init__(self, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.engine_id = settings.engine_id or f"e{uuid.uuid4().hex[:12]}"
        self.served_model_name = settings.served_model_name or backend.default_model_name
        self.subjects = Subjects(settings.subject_prefix)
        self.paused = False
        self.epoch: int | None = None
        self.control_revision = 0  # of the shared control state, as last applied
        self.counters: Counter[str] = Counter()
        self.registered = asyncio.Event()
        self._malformed_log = RateLimitedLog(log)
        self._active: dict[str, ActiveRequest] = {}
        self._wake = asyncio.Event()
        self._connected = asyncio.Event()
        self._connected.set()
        self._step_lock = asyncio.Lock()
        self._stepped = asyncio.Event()  # set after every step and abort: a drain waits on it
        self.weights = EngineWeights(self.engine_id, backend, self._step_lock)
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._steps = 0
        self._unsent: list[TokenOutput] = []  # the last step's outputs, published during the next step
        self._nc = DirectClient()
        self._replies = ReplyPublisher(
            self.engine_id, self._nc, self.subjects, self.counters, settings.recent_replies_bytes
        )

    # ------------------------------------------------------------ lifecycle

    @property
    def nc(self) -> DirectClient:
        return self._nc

    @property
    def load(self) -> int:
        return len(self._active)

    async def start(self) -> None:
        await connect_nats(
            self.settings,
            name=f"dpcoord-engine-{self.engine_id}",
            on_disconnect=self._connected.clear,
            on_reconnect=self._on_reconnect,
            nc=self._nc,
        )
        # Routed messages are the hot path: handled on nats-py's reading task (service/bus/direct.py).
        await self.nc.subscribe_direct(self.subjects.engine_wildcard(self.engine_id), self._on_routed)
        await self.nc.subscribe(self.subjects.broadcast_wildcard(), cb=self._on_broadcast)
        await flush_subscriptions(self.nc)
        self._heartbeat_task = asyncio.create_task(self._heartbeat())
        step_loop = asyncio.create_task(keep_running("step", self._step_once, self.counters))
        self._tasks = [asyncio.create_task(self._register()), self._heartbeat_task, step_loop]
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
        if self._nc.is_connected:
            await self._publish_unsent()
        if self._nc.is_connected or self._nc.is_reconnecting:
            if self._nc.is_connected:
                await self.nc.publish(
                    self.subjects.sent_by(Header.DISCONNECT, self.engine_id),
                    encode_msgpack(EngineDisconnect(self.engine_id, reason)),
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
        """Registers until a coordinator adds this engine: one that serves other weights than
        the fleet's is not added, so it loads the fleet's first (engines/weight_updates.py)."""
        subject = self.subjects.sent_by(Header.REGISTER, self.engine_id)
        delay = 0.05
        while True:
            message = encode_msgpack(
                EngineRegister(
                    self.engine_id,
                    self.settings.engine_capacity,
                    self.backend.name,
                    self.paused,
                    self.served_model_name,
                    self.weights.version,
                )
            )
            try:
                msg = await self.nc.request(subject, message, timeout=2.0)
                ack = _register_ack_decoder.decode(msg.data)
                if ack.weight_version is None or ack.weight_version == self.weights.version:
                    break
                if await self.weights.adopt(ack.weight_path or "", ack.weight_version, ack.revision):
                    continue
            except (NoRespondersError, NatsTimeoutError) as exc:
                log.info("engine_id=%s: registration not answered (%s); retrying", self.engine_id, type(exc).__name__)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("engine_id=%s: registration refused (%s); retrying", self.engine_id, _refusal(msg.data))
            except Exception:
                self.counters["loop_errors_register"] += 1
                log.exception("engine_id=%s: registration failed; retrying", self.engine_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        self.paused = ack.state != "running"
        self.epoch = ack.epoch
        self.control_revision = ack.revision
        self.registered.set()
        self._wake.set()
        log.info(
            "engine_id=%s registered with coordinator %s (model %s, state %s)",
            self.engine_id,
            ack.coordinator_id,
            self.served_model_name,
            ack.state,
        )

    async def _heartbeat(self) -> None:
        """Beats only once registered: an early beat would make the coordinator adopt, then
        re-register, this engine. After that, beats let a restarted coordinator adopt it."""
        await self.registered.wait()
        await keep_running("heartbeat", self._heartbeat_once, self.counters, self.settings.heartbeat_interval_s)

    async def _heartbeat_once(self) -> None:
        if self._connected.is_set():
            beat = Heartbeat(
                self.engine_id,
                self.load,
                self.settings.engine_capacity,
                list(self._active),
                self.served_model_name,
                self._steps,
                self.weights.version,
            )
            await self.nc.publish(self.subjects.sent_by(Header.HEARTBEAT, self.engine_id), encode_msgpack(beat))
        await asyncio.sleep(self.settings.heartbeat_interval_s)

    # ------------------------------------------------------------ requests

    async def _on_routed(self, subject: str, reply: str, data: bytes) -> None:
        """Messages routed to this engine alone; direct handlers, which publish and never wait
        for another message."""
        header = self.subjects.header_of(subject)
        spec = ENGINE_HANDLERS.get(header)
        try:
            if spec is None or spec.fanout:
                raise WireError(ErrorCode.NOT_FOUND, f"no routed message {header!r}")
            await self._dispatch(spec, reply, data)
        except WireError as exc:
            self.counters["malformed"] += 1
            self._malformed_log.warning(
                "engine_id=%s dropped %s message (%d bytes): %s", self.engine_id, header, len(data), exc
            )

    async def _dispatch(self, spec: HandlerSpec[EngineContext], reply: str, data: bytes) -> None:
        incoming = Incoming(spec.header, reply or None, detect_encoding(data), data)
        await spec.fn(self, incoming, spec.decoder.decode(data, incoming.encoding))

    async def start_request(self, routed: RoutedRequest) -> None:
        return_path = routed.return_path
        try:
            encoding = Encoding(return_path.encoding)
        except ValueError:
            self.counters["malformed"] += 1
            self._malformed_log.warning(
                "engine_id=%s request_id=%s: unknown encoding %r; dropped",
                self.engine_id,
                return_path.request_id,
                return_path.encoding,
            )
            return
        if not self._supersede(routed):
            return
        active = ActiveRequest(return_path, encoding, body=routed.body, attempt=routed.attempt)
        try:
            submit = _submit_decoder.decode(routed.body, encoding)
            check_limits(submit, self.settings, self.backend.max_context)
            prompt = submit.prompt if submit.prompt is not None else self.backend.render_chat(submit.messages or ())
            request = GenerationRequest.from_submit(return_path.request_id, submit, prompt)
            resume = routed.resume_tokens
            if resume:
                check_resume(resume, request.max_tokens)
                request.resume_tokens = tuple(resume)
            active.prompt_tokens = self.backend.add(request)
            if resume:
                active.resume(resume, self.backend.resumed_text(return_path.request_id), self.epoch)
        except Exception as exc:
            if isinstance(exc, WireError):
                err = exc
                self._malformed_log.warning(
                    "engine_id=%s request_id=%s refused: %s", self.engine_id, return_path.request_id, err
                )
            else:
                err = WireError(ErrorCode.INTERNAL, f"engine {self.engine_id} could not start the request")
                self._malformed_log.exception(
                    "engine_id=%s request_id=%s: starting it failed", self.engine_id, return_path.request_id
                )
            await self._replies.publish(Header.ENGINE_REPLY, [active.error(err)])
            return
        self._active[return_path.request_id] = active
        self._wake.set()

    def _supersede(self, routed: RoutedRequest) -> bool:
        """Whether to start ``routed``: a request routed twice is ignored, unless it starts a
        newer run (a migration back to this engine), which replaces the older one silently."""
        request_id = routed.return_path.request_id
        active = self._active.get(request_id)
        if active is None:
            return True
        if routed.attempt <= active.attempt:
            log.warning("engine_id=%s request_id=%s routed twice; ignored", self.engine_id, request_id)
            return False
        del self._active[request_id]
        self.backend.abort(request_id)
        self.counters["runs_superseded"] += 1
        return True

    async def abort_request(self, request_id: str) -> None:
        active = self._active.pop(request_id, None)
        if active is None:
            return
        self.backend.abort(request_id)
        await self._replies.publish(Header.ENGINE_REPLY, [active.final(self.engine_id, "abort")])
        self._stepped.set()

    def _on_reconnect(self) -> None:
        self._connected.set()
        self._wake.set()

    async def resend_replies(self, incoming: Incoming, resend: ResendReplies) -> None:
        again = [reply for request_id in resend.request_ids if (reply := self._replies.recent(request_id))]
        unknown = [
            request_id
            for request_id in resend.request_ids
            if self._replies.recent(request_id) is None and request_id not in self._active
        ]
        log.info(
            "engine_id=%s: sending %d replies again; %d requests never arrived",
            self.engine_id,
            len(again),
            len(unknown),
        )
        await self._replies.publish(Header.ENGINE_REPLY, again, remember=False)
        if incoming.reply:
            await self.nc.publish(incoming.reply, encode_msgpack(ResendAnswer(unknown)))

    async def _step_once(self) -> None:
        """One round of the step loop (run by :func:`~service.ops.loops.keep_running`). Steps
        while there is work, the fleet is not paused and NATS is reachable: tokens generated
        with nowhere to send them would only fill the outbound buffer. A step's replies are
        encoded and published while the next step runs (its kernels launch on the backend's
        thread meanwhile), so they stay off the step's critical path; they go out at once when
        no step follows."""
        await self._wake.wait()
        if self.paused or not self.backend.has_work() or not self._connected.is_set():
            await self._publish_unsent()
            self._stepped.set()
            self._wake.clear()
            return
        async with self._step_lock:
            if self.paused:  # a pause confirmed while this step waited for the lock
                return
            step = asyncio.ensure_future(self.backend.step())
            try:
                await self._publish_unsent()
            finally:
                outputs = await self._finish_step(step)
        self._unsent = outputs
        if not self.backend.has_work():
            await self._publish_unsent()
        self._stepped.set()
        # Between steps, let the reader and nats-py's flusher run: a backend's step need not
        # yield, and yielding after publishing sends this step's replies a loop turn sooner.
        await asyncio.sleep(0)

    async def _finish_step(self, step: asyncio.Future[list[TokenOutput]]) -> list[TokenOutput]:
        """The step's outputs; a failed step fails every request this engine holds."""
        try:
            outputs = await step
        except Exception as exc:
            log.exception("engine_id=%s: step failed; failing its %d requests", self.engine_id, len(self._active))
            await self._fail_all(WireError(ErrorCode.INTERNAL, f"engine {self.engine_id} step failed: {exc}"))
            return []
        self._steps += 1
        return outputs

    async def _publish_unsent(self) -> None:
        """Publish the last step's replies, if not yet sent."""
        outputs, self._unsent = self._unsent, []
        if not outputs:
            return
        try:
            await self._publish_outputs(outputs)
        except Exception:
            # Tokens of this step may be lost: its requests end with an error rather than a gap.
            log.exception(
                "engine_id=%s: replies of a step failed; failing its %d requests", self.engine_id, len(outputs)
            )
            err = WireError(ErrorCode.INTERNAL, f"engine {self.engine_id} could not send a step's replies")
            await self._fail([output.request_id for output in outputs], err)

    async def _fail_all(self, err: WireError) -> list[ActiveRequest]:
        return await self._fail(list(self._active), err)

    async def _fail(self, request_ids: list[str], err: WireError) -> list[ActiveRequest]:
        """End the named requests this engine still holds with ``err``."""
        failed = [active for request_id in request_ids if (active := self._active.pop(request_id, None)) is not None]
        for active in failed:
            self.backend.abort(active.return_path.request_id)
        await self._replies.publish(Header.ENGINE_REPLY, [active.error(err) for active in failed])
        self._stepped.set()
        return failed

    async def _publish_outputs(self, outputs: list[TokenOutput]) -> None:
        interval = self.settings.stream_interval
        partials: list[RoutedReply] = []
        finals: list[RoutedReply] = []
        for output in outputs:
            active = self._active.get(output.request_id)
            if active is None:
                continue
            active.record(output, self.epoch, self.weights.version)
            if output.finish_reason is not None:
                del self._active[output.request_id]
                if active.return_path.stream and active.unsent_tokens:
                    partials.append(active.partial())
                finals.append(active.final(self.engine_id, output.finish_reason))
            elif active.return_path.stream and len(active.unsent_tokens) >= interval:
                partials.append(active.partial())
        await self._replies.publish(Header.ENGINE_REPLY_PARTIAL, partials)
        await self._replies.publish(Header.ENGINE_REPLY, finals)

    # ------------------------------------------------------------ control

    async def _on_broadcast(self, msg: Msg) -> None:
        """Broadcasts to every engine, each answered with an ``EngineAck``."""
        header = self.subjects.header_of(msg.subject)
        spec = ENGINE_HANDLERS.get(header)
        if spec is None or not spec.fanout:
            self.counters["malformed"] += 1
            self._malformed_log.warning("engine_id=%s: unknown broadcast %s", self.engine_id, header)
            return
        if header in CONTROL_HEADERS and (superseded := self._superseded(msg.data)) is not None:
            await self._answer(msg.reply, EngineAck(self.engine_id, header, True, superseded))
            return
        try:
            await self._dispatch(spec, msg.reply, msg.data)
        except WireError as exc:
            self.counters["malformed"] += 1
            await self._answer(
                msg.reply, EngineAck(self.engine_id, header, False, f"undecodable signal: {exc.message}")
            )
        except Exception as exc:
            log.exception("engine_id=%s: %s failed", self.engine_id, header)
            await self._answer(msg.reply, EngineAck(self.engine_id, header, False, f"{type(exc).__name__}: {exc}"))

    def _superseded(self, body: bytes) -> str | None:
        """Broadcasts are handled one at a time, in arrival order, but replicas send them
        independently: a control signal whose revision is not newer than the last applied is
        confirmed without effect (the detail says why); a newer one brings its record's epoch.
        None: apply it (also when it carries no revision, or does not decode: the handler
        reports that)."""
        try:
            signal = _signal_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if signal.revision is None:
            return None
        if signal.revision <= self.control_revision:
            self.counters["superseded_signals"] += 1
            return f"superseded by revision {self.control_revision}"
        self.control_revision = signal.revision
        self.epoch = signal.epoch
        return None

    async def hand_over(self, incoming: Incoming, adoption: Adoption) -> None:
        adopted = [
            active.hand_over(adoption.adopter)
            for active in self._active.values()
            if active.return_path.coordinator_id == adoption.dead
        ]
        log.warning(
            "engine_id=%s: %d requests of coordinator %s handed to %s",
            self.engine_id,
            len(adopted),
            adoption.dead,
            adoption.adopter,
        )
        ack = EngineAck(self.engine_id, incoming.header, True, f"{len(adopted)} requests", adopted=adopted)
        await self._answer(incoming.reply, ack)

    async def confirm(self, incoming: Incoming, detail: str = "") -> None:
        await self._answer(incoming.reply, EngineAck(self.engine_id, incoming.header, True, detail))

    async def _answer(self, reply: str | None, ack: EngineAck) -> None:
        if reply:
            await self.nc.publish(reply, encode_msgpack(ack))

    async def pause(self, mode: PauseMode | None = None) -> None:
        """Confirmed (by the handler) once no step runs, on the accelerator too. ``drain``
        first lets the requests in flight finish; ``abort`` then ends them with their tokens."""
        if mode == "drain" and not self.paused:
            while self._active:
                self._stepped.clear()
                await self._stepped.wait()
        async with self._step_lock:
            self.paused = True
            await self._publish_unsent()  # a confirmed pause leaves no generated token unsent
            await self.backend.quiesce()
            if mode == "abort":
                aborted = list(self._active.values())
                self._active.clear()
                for active in aborted:
                    self.backend.abort(active.return_path.request_id)
                finals = [active.final(self.engine_id, "abort") for active in aborted]
                await self._replies.publish(Header.ENGINE_REPLY, finals)

    async def unpause(self) -> None:
        self.paused = False
        self._wake.set()

    async def suspend(self) -> None:
        async with self._step_lock:
            self.paused = True
            await self._publish_unsent()
            await self.backend.suspend()

    async def resume(self) -> None:
        await self.backend.resume()

    async def stop_serving(self) -> str:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        async with self._step_lock:
            self.paused = True
            failed = await self._fail_all(
                WireError(ErrorCode.NO_ENGINE, f"engine {self.engine_id} stopped by control signal")
            )
        return f"{len(failed)} requests failed"

    def set_epoch(self, epoch: int | None) -> None:
        self.epoch = epoch

    async def prepare_weights(self, signal: WeightSignal) -> EngineAck:
        return await self.weights.prepare(signal)

    def discard_weights(self, signal: WeightSignal) -> None:
        self.weights.discard(signal)

    async def commit_weights(self, signal: WeightSignal) -> EngineAck:
        """An engine that cannot serve the committed weights leaves the pool (the coordinator
        removes it and routes its requests again) and registers again, which loads them first;
        the requests it held are dropped without replies, as an engine that restarted."""
        ack = await self.weights.commit(signal)
        if not ack.ok and self.registered.is_set():
            self.registered.clear()
            for request_id in list(self._active):
                self.backend.abort(request_id)
            self._active.clear()
            self._tasks.append(asyncio.create_task(self._register()))
        return ack

    async def acknowledge(self, incoming: Incoming, ack: EngineAck) -> None:
        await self._answer(incoming.reply, ack)

    def start_profiler(self) -> str:
        return self.backend.start_profiler()

    def stop_profiler(self) -> str:
        return self.backend.stop_profiler()


def _refusal(body: bytes) -> str:
    """The message of a coordinator's error reply, for the log."""
    try:
        error = _register_error_decoder.decode(body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return f"undecodable answer of {len(body)} bytes"
    return f"{error.code}: {error.message}"
