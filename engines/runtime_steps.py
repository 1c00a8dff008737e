"""The step loop: steps the backend while there is work, and publishes each step's replies
(partials every ``stream_interval`` tokens, finals) while the next step runs."""

from __future__ import annotations

import asyncio
import logging

from engines.backend import TokenOutput
from engines.replies import ActiveRequest
from engines.runtime_core import RuntimeCore
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import RoutedReply
from service.protocol.subjects import Header

log = logging.getLogger(__name__)


class StepLoop(RuntimeCore):
    async def _step_once(self) -> None:
        """One round of the step loop (run by :func:`~service.ops.loops.keep_running`). Steps
        while there is work, the fleet is not paused and NATS is reachable: tokens generated
        with nowhere to send them would only fill the outbound buffer.

        A step's replies stay off the critical path either way: a backend that launches steps
        ahead (``Backend.launches_ahead``) has its next step queued on the device when ``step``
        returns, so they are encoded and published at once, with no thread competing for the
        GIL with the one that launches; otherwise they are encoded and published while the
        next step runs (its kernels launch on the backend's thread meanwhile), and at once when
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
        if self.backend.launches_ahead or not self.backend.has_work():
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
        self.pace.stepped(outputs, self._active)
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
