"""Control: the transition table applied to this replica's state, broadcast to every engine,
acknowledged once every engine confirmed.

Contract:
- A signal the transition table forbids in the current state is refused with 409 and changes
  nothing; a repeat that changes nothing is acknowledged at once.
- Otherwise the new state (and epoch) is recorded before the broadcast, so a submission that
  arrives meanwhile already sees it; the ``Ack`` goes out once every engine confirmed, else
  an error names the engines that did not (504) or failed (500), and the change stands.
- After ``unpause`` queued requests are routed; after ``stop`` every engine is forgotten and the
  coordinator runs again for new ones.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from msgspec import Struct

from service.bus.direct import DirectClient
from service.bus.registry import Incoming
from service.coordinator.admission import Admission
from service.coordinator.broadcast import BroadcastResult, broadcast
from service.coordinator.control_state import ControlState
from service.coordinator.fleet import Fleet
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import Ack, ControlSignal, error_reply
from service.protocol.state import CoordinatorState, decide
from service.protocol.subjects import PROFILER_HEADERS, Header, Subjects

log = logging.getLogger(__name__)

Reply = Callable[[Incoming, Struct], Awaitable[None]]


class Control:
    def __init__(
        self,
        settings: Settings,
        nc: DirectClient,
        subjects: Subjects,
        current: ControlState,
        fleet: Fleet,
        admission: Admission,
        counters: Counter[str],
        reply: Reply,
    ) -> None:
        self._settings = settings
        self._nc = nc
        self._subjects = subjects
        self.current = current
        self._fleet = fleet
        self._admission = admission
        self._counters = counters
        self._reply = reply

    async def apply(self, signal: Header, payload: ControlSignal) -> tuple[bool, CoordinatorState]:
        """Record ``signal``'s transition: (whether it changed anything, the new state)."""
        decision = decide(self.current.state, signal)
        if not decision.changes:
            return False, decision.new_state
        self.current.state = decision.new_state
        if signal is Header.SET_GENERATION_EPOCH:
            self.current.epoch = payload.epoch
        log.info("control %s: state %s", signal, decision.new_state)
        return True, decision.new_state

    async def broadcast(self, signal: Header, payload: ControlSignal) -> BroadcastResult:
        expected = {record.engine_id for record in self._fleet.pool}
        return await broadcast(
            self._nc, self._subjects.broadcast(signal), encode_msgpack(payload), expected, self._settings.control_timeout_s
        )

    async def control_engines(self, incoming: Incoming, signal: Header, payload: ControlSignal, state: CoordinatorState) -> None:
        result = await self.broadcast(signal, payload)
        if signal is Header.STOP:
            await self._fleet.remove_all("stopped")
            self.current.state = CoordinatorState.RUNNING
        elif signal is Header.UNPAUSE:
            await self._admission.release_queue()
        if signal in PROFILER_HEADERS:
            details = {engine_id: ack.detail for engine_id, ack in result.acks.items()}
            ack = Ack(signal, state=state, engines=details)
        else:
            ack = Ack(signal, state=state, epoch=payload.epoch)
        await self._answer(incoming, signal, result, ack)

    async def _answer(self, incoming: Incoming, signal: Header, result: BroadcastResult, ack: Ack) -> None:
        if result.missing:
            names = ", ".join(sorted(result.missing))
            err = WireError(ErrorCode.TIMED_OUT, f"{signal}: no confirmation from engines {names} (state change stands)")
        elif result.failed:
            names = ", ".join(f"{engine_id}: {detail}" for engine_id, detail in sorted(result.failed.items()))
            err = WireError(ErrorCode.INTERNAL, f"{signal} failed on engines {names}")
        else:
            await self._reply(incoming, ack)
            return
        self._counters[f"error_{err.code}"] += 1
        log.warning("%s", err.message)
        await self._reply(incoming, error_reply(err))
