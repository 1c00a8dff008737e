"""Enrolment: which engines join this replica's pool, as they register and heartbeat.

Contract: an engine that serves other weights than the fleet's recorded version (the shared
control record, :mod:`.weights`) is not added when it registers, nor adopted from its
heartbeats (``engines_on_other_weights``); its register answer names the recorded version and
path, so it loads them and registers again. Every register answer carries the control state,
epoch and revision the engine must start in. A pool engine's heartbeats tell the weight
updates which version it serves, so one left behind is repaired.
"""

from __future__ import annotations

import logging

from service.bus.registry import Incoming
from service.coordinator.control_state import ControlState
from service.coordinator.core import Core
from service.coordinator.fleet import Fleet
from service.coordinator.ledger import RequestLedger
from service.coordinator.shared_state import SharedControlState
from service.coordinator.weights import WeightUpdates
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import encode_msgpack
from service.protocol.membership import Heartbeat, RegisterAck
from service.protocol.messages import WeightVersion

log = logging.getLogger(__name__)


class Enrolment:
    def __init__(
        self,
        core: Core,
        ledger: RequestLedger,
        control_state: ControlState,
        shared: SharedControlState,
        fleet: Fleet,
        weights: WeightUpdates,
    ) -> None:
        self._core = core
        self._ledger = ledger
        self._control_state = control_state
        self._shared = shared
        self._fleet = fleet
        self._weights = weights
        self._refusal_log = RateLimitedLog(log)

    async def register(
        self,
        incoming: Incoming,
        engine_id: str,
        capacity: int,
        model: str | None,
        weight_version: WeightVersion | None,
        logprobs: bool = False,
    ) -> None:
        other_weights = self._on_other_weights(engine_id, weight_version)
        if other_weights:
            await self._fleet.remove(engine_id, "serves other weights than the fleet's")
        else:
            await self._fleet.register(
                engine_id, capacity, model, own_subjects=incoming.sender is not None, logprobs=logprobs
            )
        if incoming.reply:
            state = self._control_state
            ack = RegisterAck(
                self._core.id, state.state, state.epoch, self._shared.revision, state.weight_version, state.weight_path
            )
            await self._core.nc.publish(incoming.reply, encode_msgpack(ack))
        if not other_weights:
            self._ledger.release()

    async def heartbeat(self, heartbeat: Heartbeat, own_subjects: bool) -> None:
        if self._fleet.pool.get(heartbeat.engine_id) is None:
            if self._on_other_weights(heartbeat.engine_id, heartbeat.weight_version):
                return  # never adopted: it registers once it serves the fleet's weights
        else:
            self._weights.heard(heartbeat.engine_id, heartbeat.weight_version)
        await self._fleet.heartbeat(heartbeat, own_subjects)

    def _on_other_weights(self, engine_id: str, weight_version: WeightVersion | None) -> bool:
        """True (and counted) for an engine that does not serve the fleet's recorded weights."""
        fleet_version = self._control_state.weight_version
        if fleet_version is None or weight_version == fleet_version:
            return False
        self._core.counters["engines_on_other_weights"] += 1
        self._refusal_log.warning(
            "engine_id=%s serves weights %r, the fleet %r: not added until it loads them",
            engine_id,
            weight_version,
            fleet_version,
        )
        return True
