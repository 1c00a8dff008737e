"""Control: the fleet's control signals (pause, unpause, suspend, resume, stop, epochs), the
profiler, and the hand-over of a dead coordinator's requests, as broadcast to every engine.

Contract: pause is a barrier: it returns once no step runs, on the accelerator too, with every
generated token sent (``drain`` first lets the requests in flight finish; ``abort`` then ends
them with their tokens). Suspend frees the backend's memory while paused and keeps the
requests; stop fails every request and silences the heartbeats. A control signal whose
revision is not newer than the last applied is confirmed without effect (:meth:`superseded`,
applied by the dispatch before any handler). The requests change only through the request
table; the step loop's and membership's actions come in as callables from the wiring.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from engines.control_state import ControlState
from engines.requests import RequestTable
from engines.runtime_core import EngineCore
from service.bus.registry import Incoming
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import Adoption
from service.protocol.messages import PauseMode
from service.protocol.routed import EngineAck, EngineSignal

log = logging.getLogger(__name__)


class ControlSignals:
    def __init__(
        self,
        core: EngineCore,
        requests: RequestTable,
        control: ControlState,
        *,
        publish_unsent: Callable[[], Awaitable[None]],
        stop_heartbeats: Callable[[], None],
    ) -> None:
        self._core = core
        self._engine_id = core.engine_id
        self._backend = core.backend
        self._step_lock = core.step_lock
        self._counters = core.counters
        self._requests = requests
        self._control = control
        self._publish_unsent = publish_unsent
        self._stop_heartbeats = stop_heartbeats

    def superseded(self, signal: EngineSignal) -> str | None:
        """Why ``signal`` is confirmed without effect, or None to apply it (its record's epoch
        is this engine's from now on when it carries a revision)."""
        detail = self._control.apply(signal)
        if detail is not None:
            self._counters["superseded_signals"] += 1
        return detail

    async def pause(self, mode: PauseMode | None = None) -> None:
        """Returns once no step runs, on the accelerator too. ``drain`` first lets the requests
        in flight finish; ``abort`` then ends them with their tokens."""
        if mode == "drain" and not self._control.paused:
            await self._requests.emptied()
        async with self._step_lock:
            self._control.pause()
            await self._publish_unsent()  # a confirmed pause leaves no generated token unsent
            await self._backend.quiesce()
            if mode == "abort":
                await self._requests.abort_all()

    async def unpause(self) -> None:
        self._control.unpause()
        self._core.wake.set()

    async def suspend(self) -> None:
        async with self._step_lock:
            self._control.pause()
            await self._publish_unsent()
            await self._backend.suspend()

    async def resume(self) -> None:
        await self._backend.resume()

    async def stop_serving(self) -> str:
        self._stop_heartbeats()
        async with self._step_lock:
            self._control.pause()
            failed = await self._requests.fail_all(
                WireError(ErrorCode.NO_ENGINE, f"engine {self._engine_id} stopped by control signal")
            )
        return f"{failed} requests failed"

    def set_epoch(self, epoch: int | None) -> None:
        self._control.set_epoch(epoch)

    def start_profiler(self) -> str:
        return self._backend.start_profiler()

    def stop_profiler(self) -> str:
        return self._backend.stop_profiler()

    async def hand_over(self, incoming: Incoming, adoption: Adoption) -> None:
        adopted = self._requests.hand_over(adoption.dead, adoption.adopter)
        log.warning(
            "engine_id=%s: %d requests of coordinator %s handed to %s",
            self._engine_id,
            len(adopted),
            adoption.dead,
            adoption.adopter,
        )
        ack = EngineAck(self._engine_id, incoming.header, True, f"{len(adopted)} requests", adopted=adopted)
        await self._core.answer(incoming.reply, ack)
