"""Broadcasts to every engine: control signals (pause, suspend, stop, epochs), weight
updates, profiler, and hand-overs of a dead coordinator's requests; each answered with an
``EngineAck``. Replicas broadcast independently, so a control signal older than the last
applied is confirmed without effect."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.aio.msg import Msg

from engines.handlers import ENGINE_HANDLERS
from engines.runtime_membership import Membership
from engines.runtime_steps import StepLoop
from service.bus.registry import Incoming
from service.protocol.codec import msgpack_decoder
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import Adoption
from service.protocol.messages import EngineAck, EngineSignal, PauseMode, WeightSignal
from service.protocol.subjects import CONTROL_HEADERS, Header

log = logging.getLogger(__name__)

_signal_decoder = msgpack_decoder(EngineSignal)


class ControlSignals(StepLoop, Membership):
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
