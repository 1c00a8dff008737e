"""The engine's membership of the pool: registration (retried until a coordinator adds it)
and heartbeats with its load, step count and weight version."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from engines.runtime_core import RuntimeCore
from service.ops.loops import keep_running
from service.protocol.codec import encode_msgpack, msgpack_decoder
from service.protocol.membership import EngineRegister, Heartbeat, RegisterAck
from service.protocol.messages import ErrorReply
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

_register_ack_decoder = msgpack_decoder(RegisterAck)
_register_error_decoder = msgpack_decoder(ErrorReply)


class Membership(RuntimeCore):
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


def _refusal(body: bytes) -> str:
    """The message of a coordinator's error reply, for the log."""
    try:
        error = _register_error_decoder.decode(body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return f"undecodable answer of {len(body)} bytes"
    return f"{error.code}: {error.message}"
