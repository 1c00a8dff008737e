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

The runtime is put together from one module per job on a shared core
(:mod:`engines.runtime_core`): membership, routed requests, the step loop and control.
"""

from __future__ import annotations

import asyncio
import logging

from engines.handlers import EngineContext
from engines.runtime_control import ControlSignals
from engines.runtime_requests import RequestIntake
from service.bus.connection import close_nats, connect_nats, flush_subscriptions
from service.ops.loops import keep_running
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect
from service.protocol.subjects import Header

log = logging.getLogger(__name__)


class EngineRuntime(RequestIntake, ControlSignals):
    """One data-parallel rank: every handler's :class:`~engines.handlers.EngineContext`."""

    def _context(self) -> EngineContext:
        return self

    # ------------------------------------------------------------ lifecycle

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

    def _on_reconnect(self) -> None:
        self._connected.set()
        self._wake.set()
