"""Weight updates, as broadcast to every engine: ``prepare_weights``, ``commit_weights`` and
``discard_weights`` (the two phases of ``update_weights``, docs/protocol.md), answered with
the ``EngineAck`` of :class:`engines.weight_updates.EngineWeights`, which owns the weights.

Contract: an engine that cannot serve the committed weights leaves the pool (the coordinator
removes it and routes its requests again) and registers again, which loads them first; the
requests it held are dropped without replies, as an engine that restarted would. Rejoining is
membership's action, passed in by the wiring.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engines.requests import RequestTable
from engines.weight_updates import EngineWeights
from service.protocol.routed import EngineAck, WeightSignal

log = logging.getLogger(__name__)


class WeightUpdates:
    def __init__(self, weights: EngineWeights, requests: RequestTable, *, rejoin: Callable[[], bool]) -> None:
        self._weights = weights
        self._requests = requests
        self._rejoin = rejoin

    async def prepare(self, signal: WeightSignal) -> EngineAck:
        return await self._weights.prepare(signal)

    def discard(self, signal: WeightSignal) -> None:
        self._weights.discard(signal)

    async def commit(self, signal: WeightSignal) -> EngineAck:
        ack = await self._weights.commit(signal)
        if not ack.ok and self._rejoin():
            dropped = self._requests.drop_all()
            log.warning("engine_id=%s: rejoining the pool; %d requests dropped", ack.engine_id, dropped)
        return ack
