"""The engine's membership of the pool: registration (retried until a coordinator adds it),
heartbeats with its load, held requests, step count, weight version and, for an engine that
publishes KV events, the number of its last one (``kv_sequence``), and rejoining.

Contract: registration retries whatever goes wrong; an engine whose weights are not the
fleet's loads the fleet's first (:meth:`engines.weight_updates.EngineWeights.adopt`) and
registers again. Its answer sets the control state (:meth:`ControlState.joined`). Heartbeats
start once registered and stop for good after a stop signal (:meth:`stop_heartbeats`).
:meth:`rejoin` leaves the pool and registers again (an engine that could not swap in the
fleet's weights).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from engines.control_state import ControlState
from engines.requests import RequestTable
from engines.runtime_core import EngineCore
from engines.weight_updates import EngineWeights
from service.ops.loops import keep_running
from service.protocol.codec import encode_msgpack, msgpack_decoder
from service.protocol.membership import LOGPROBS, EngineRegister, Heartbeat, RegisterAck
from service.protocol.messages import ErrorReply
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

_register_ack_decoder = msgpack_decoder(RegisterAck)
_register_error_decoder = msgpack_decoder(ErrorReply)


class Membership:
    def __init__(
        self,
        core: EngineCore,
        requests: RequestTable,
        control: ControlState,
        weights: EngineWeights,
        served_model_name: str,
        steps: Callable[[], int],
        kv_sequence: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._core = core
        self._engine_id = core.engine_id
        self._settings = core.settings
        self._requests = requests
        self._control = control
        self._weights = weights
        self._served_model_name = served_model_name
        self._features = [LOGPROBS] if core.backend.computes_logprobs else None
        self._steps = steps
        self._kv_sequence = kv_sequence  # read as each message is built, after the events sent before it
        self.registered = asyncio.Event()  # set once a coordinator added this engine
        self._beating = True

    async def register(self) -> None:
        """Registers until a coordinator adds this engine: one that serves other weights than
        the fleet's is not added, so it loads the fleet's first (engines/weight_updates.py)."""
        core = self._core
        subject = core.subjects.sent_by(Header.REGISTER, self._engine_id)
        delay = 0.05
        while True:
            message = encode_msgpack(
                EngineRegister(
                    self._engine_id,
                    self._settings.engine_capacity,
                    core.backend.name,
                    self._control.paused,
                    self._served_model_name,
                    self._weights.version,
                    self._kv_sequence(),
                    features=self._features,
                )
            )
            try:
                msg = await core.nc.request(subject, message, timeout=2.0)
                ack = _register_ack_decoder.decode(msg.data)
                if ack.weight_version is None or ack.weight_version == self._weights.version:
                    break
                if await self._weights.adopt(ack.weight_path or "", ack.weight_version, ack.revision):
                    continue
            except (NoRespondersError, NatsTimeoutError) as exc:
                log.info("engine_id=%s: registration not answered (%s); retrying", self._engine_id, type(exc).__name__)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("engine_id=%s: registration refused (%s); retrying", self._engine_id, _refusal(msg.data))
            except Exception:
                core.counters["loop_errors_register"] += 1
                log.exception("engine_id=%s: registration failed; retrying", self._engine_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        self._control.joined(ack.state, ack.epoch, ack.revision)
        self.registered.set()
        core.wake.set()
        log.info(
            "engine_id=%s registered with coordinator %s (model %s, state %s)",
            self._engine_id,
            ack.coordinator_id,
            self._served_model_name,
            ack.state,
        )

    def rejoin(self) -> bool:
        """Leave the pool and register again; False (nothing done) while a registration is
        under way already."""
        if not self.registered.is_set():
            return False
        self.registered.clear()
        self._core.spawn(self.register())
        return True

    async def heartbeats(self) -> None:
        """Beats only once registered: an early beat would make the coordinator adopt, then
        re-register, this engine. After that, beats let a restarted coordinator adopt it."""
        await self.registered.wait()
        await keep_running("heartbeat", self.heartbeat_once, self._core.counters, self._settings.heartbeat_interval_s)

    def stop_heartbeats(self) -> None:
        self._beating = False

    async def heartbeat_once(self) -> None:
        core = self._core
        if self._beating and core.connected.is_set():
            held = self._requests.ids()
            beat = Heartbeat(
                self._engine_id,
                len(held),
                self._settings.engine_capacity,
                held,
                self._served_model_name,
                self._steps(),
                self._weights.version,
                kv_sequence=self._kv_sequence(),
                held=self._requests.held_back() or None,
                features=self._features,
            )
            await core.nc.publish(core.subjects.sent_by(Header.HEARTBEAT, self._engine_id), encode_msgpack(beat))
        await asyncio.sleep(self._settings.heartbeat_interval_s)


def _refusal(body: bytes) -> str:
    """The message of a coordinator's error reply, for the log."""
    try:
        error = _register_error_decoder.decode(body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return f"undecodable answer of {len(body)} bytes"
    return f"{error.code}: {error.message}"
