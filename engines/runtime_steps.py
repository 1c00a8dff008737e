"""The step loop: steps the backend while there is work, and has each step's outputs recorded
in the request table (which sends their partials and finals) while the next step runs.

Contract: it steps only while the engine is not paused, the backend has work and NATS is
reachable (tokens generated with nowhere to send them would only fill the outbound buffer).
A step that fails fails every request held; a step whose replies cannot be built or sent
fails its requests (an error rather than a stream with a gap). :meth:`publish_unsent` sends
what the last step produced and is called by whatever must leave no generated token unsent
(a confirmed pause, a suspend, the engine stopping). Each step's start and end are read once
(two clock readings per step) and recorded with its outputs: the requests' timings and spans
are made from them (:mod:`engines.requests`). After every step, and when it goes idle, it has
what the step changed in the prefix cache published (``after_step``, the KV events job's
action, passed in by the wiring).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from engines.backend import TokenOutput
from engines.control_state import ControlState
from engines.requests import RequestTable
from engines.runtime_core import EngineCore
from engines.token_pace import TokenPace
from engines.weight_updates import EngineWeights
from service.protocol.errors import ErrorCode, WireError

log = logging.getLogger(__name__)


class StepLoop:
    def __init__(
        self,
        core: EngineCore,
        requests: RequestTable,
        control: ControlState,
        weights: EngineWeights,
        after_step: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._engine_id = core.engine_id
        self._backend = core.backend
        self._wake = core.wake
        self._connected = core.connected
        self._step_lock = core.step_lock
        self._requests = requests
        self._control = control
        self._weights = weights
        self._after_step = after_step
        self.steps = 0  # steps taken, in heartbeats: an engine that holds requests and never steps is suspected
        self.pace = TokenPace()  # tokens generated and inter-token latency, for /metrics
        self._unsent: list[TokenOutput] = []  # the last step's outputs, published during the next step
        self._unsent_step = (0.0, 0.0)  # when the step that made them started and ended (monotonic)

    async def step_once(self) -> None:
        """One round of the step loop (run by :func:`~service.ops.loops.keep_running`).

        A step's replies stay off the critical path either way: a backend that launches steps
        ahead (``Backend.launches_ahead``) has its next step queued on the device when ``step``
        returns, so they are encoded and published at once, with no thread competing for the
        GIL with the one that launches; otherwise they are encoded and published while the
        next step runs (its kernels launch on the backend's thread meanwhile), and at once when
        no step follows."""
        await self._wake.wait()
        backend = self._backend
        if self._control.paused or not backend.has_work() or not self._connected.is_set():
            self._wake.clear()  # before publishing: a wake while it publishes (a request, a release) is kept
            await self.publish_unsent()
            if self._after_step is not None:
                await self._after_step()
            return
        async with self._step_lock:
            if self._control.paused:  # a pause confirmed while this step waited for the lock
                return
            started = time.monotonic()
            step = asyncio.ensure_future(backend.step())
            try:
                await self.publish_unsent()
            finally:
                outputs = await self._finish_step(step)
        ended = time.monotonic()
        if self._after_step is not None:
            await self._after_step()
        self._unsent, self._unsent_step = outputs, (started, ended)
        if backend.launches_ahead or not backend.has_work():
            await self.publish_unsent()
        # Between steps, let the reader and nats-py's flusher run: a backend's step need not
        # yield, and yielding after publishing sends this step's replies a loop turn sooner.
        await asyncio.sleep(0)

    async def _finish_step(self, step: asyncio.Future[list[TokenOutput]]) -> list[TokenOutput]:
        """The step's outputs; a failed step fails every request this engine holds."""
        try:
            outputs = await step
        except Exception as exc:
            log.exception("engine_id=%s: step failed; failing its %d requests", self._engine_id, len(self._requests))
            await self._requests.fail_all(WireError(ErrorCode.INTERNAL, f"engine {self._engine_id} step failed: {exc}"))
            return []
        self.steps += 1
        self.pace.stepped(outputs, self._requests.records)  # the last step's outputs are recorded by now
        return outputs

    async def publish_unsent(self) -> None:
        """Record the last step's outputs and send their replies, if not done yet."""
        outputs, self._unsent = self._unsent, []
        if not outputs:
            return
        started, ended = self._unsent_step
        try:
            await self._requests.record_step(outputs, self._control.epoch, self._weights.version, started, ended)
        except Exception:
            # Tokens of this step may be lost: its requests end with an error rather than a gap.
            log.exception(
                "engine_id=%s: replies of a step failed; failing its %d requests", self._engine_id, len(outputs)
            )
            err = WireError(ErrorCode.INTERNAL, f"engine {self._engine_id} could not send a step's replies")
            await self._requests.fail([output.request_id for output in outputs], err)
