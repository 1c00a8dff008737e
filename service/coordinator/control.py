"""Control: the transition table applied to the control state that every replica of the prefix
shares, broadcast to every engine, acknowledged once every engine confirmed.

Contract:
- A signal is validated against the transition table on the shared record as read from the
  bucket, and written with compare-and-set (:mod:`service.coordinator.shared_state`): a
  signal the table forbids is refused with 409 by every replica alike and changes nothing;
  a repeat that changes nothing is acknowledged at once.
- Otherwise the record is written before the broadcast, so a submission that arrives
  meanwhile already sees it; the broadcast carries the record's revision, so engines end in
  the state of the newest signal whichever replica's broadcast reaches them last. The
  ``Ack`` goes out once every engine confirmed, else an error names the engines that did
  not (504) or failed (500), and the change stands.
- Every replica follows the record (``current``), whichever replica wrote it: queued
  requests are routed when it reaches ``running``; when a stop is over every engine is
  forgotten and the replica runs again for new ones; a raised shutdown count stops it.
- A stop whose replica died before finishing it is finished by the surviving replica with
  the lowest id. Without JetStream a replica that hears another one on the prefix stops,
  unless its id is the lower.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from msgspec import Struct

from service.bus.registry import Incoming
from service.coordinator.broadcast import BroadcastResult, broadcast
from service.coordinator.control_state import ControlState
from service.coordinator.core import Core
from service.coordinator.ledger import RequestLedger
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.pool import EnginePool
from service.coordinator.shared_state import SharedControlState
from service.protocol.codec import encode, encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import Ack, ControlSignal, error_reply
from service.protocol.routed import EngineSignal
from service.protocol.state import STOP_DONE, ControlRecord, CoordinatorState, Written
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

# Forget every engine (a stop is over): the fleet's job, passed in by the coordinator.
ForgetEngines = Callable[[str], Awaitable[None]]


class Control:
    def __init__(
        self,
        core: Core,
        ledger: RequestLedger,
        current: ControlState,
        pool: EnginePool,
        peers: CoordinatorPeers,
        *,
        forget_engines: ForgetEngines,
        request_stop: Callable[[], None],
    ) -> None:
        self._id = core.id
        self._settings = settings = core.settings
        self._nc = core.nc
        self._subjects = core.subjects
        self._ledger = ledger
        self.current = current
        self._pool = pool
        self._peers = peers
        self._counters = core.counters
        self._spawn = core.spawn
        self._forget_engines = forget_engines
        self._request_stop = request_stop
        self.shared = SharedControlState(core.subjects.prefix, core.id, settings.control_timeout_s, self._follow)
        self.failure: str | None = None  # why this replica stopped itself, if it did
        self.fleet_shutdown = False  # every replica of the prefix stops: none is left to adopt
        self.changed = asyncio.Event()  # set whenever this replica learns a newer record
        self._finishing_stop = False
        self._stopping_since = 0.0

    # ------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Read the shared record before the coordinator serves (raises ReplicaConflict)."""
        await self.shared.open(self._nc)
        self.current.copy_from(self.shared.record)

    async def close(self) -> None:
        await self.shared.close()

    def reconnected(self) -> None:
        self.shared.reconnected()

    # ------------------------------------------------------------ signals

    async def apply(self, signal: Header, payload: ControlSignal) -> Written:
        """Write ``signal``'s transition to the shared record; 409 when the table forbids it."""
        written = await self.shared.apply_signal(signal, payload.epoch, payload.retry)
        if written.changed:
            log.info("control %s: state %s, revision %d", signal, written.record.state, written.revision)
        return written

    async def _reply(self, incoming: Incoming, message: Struct) -> None:
        if incoming.reply:
            await self._nc.publish(incoming.reply, encode(message, incoming.encoding))

    async def broadcast(self, signal: Header, payload: EngineSignal) -> BroadcastResult:
        expected = {record.engine_id for record in self._pool}
        timeout_s = (
            self._settings.long_control_timeout_s if payload.mode == "drain" else self._settings.control_timeout_s
        )
        return await broadcast(self._nc, self._subjects.broadcast(signal), encode_msgpack(payload), expected, timeout_s)

    async def control_engines(
        self, incoming: Incoming, signal: Header, payload: ControlSignal, written: Written | None
    ) -> None:
        """``written`` is what a control signal wrote; None for profiler signals, which change no state."""
        if written is None:
            result = await self.broadcast(signal, EngineSignal(payload.epoch))
            details = {engine_id: ack.detail for engine_id, ack in result.acks.items()}
            await self._answer(incoming, signal, result, Ack(signal, state=self.current.state, engines=details))
            return
        revision = written.revision if self.shared.shared else None
        mode = payload.mode if signal is Header.PAUSE else None
        if signal is Header.STOP and written.record.state is not CoordinatorState.STOPPING:
            # A retry after the stop ended: its engines are gone, those that joined since stay.
            await self._reply(incoming, Ack(signal, state=written.record.state, revision=written.revision))
            return
        result = await self.broadcast(signal, EngineSignal(written.record.epoch, revision, mode))
        if signal is Header.STOP:
            try:
                await self.finish_stop()
            except WireError as err:
                await self._reply(incoming, error_reply(err))
                return
        epoch = written.record.epoch if signal is Header.SET_GENERATION_EPOCH else None
        ack = Ack(signal, state=written.record.state, epoch=epoch, revision=written.revision, mode=mode)
        await self._answer(incoming, signal, result, ack)

    async def _answer(self, incoming: Incoming, signal: Header, result: BroadcastResult, ack: Ack) -> None:
        if result.missing:
            names = ", ".join(sorted(result.missing))
            err = WireError(
                ErrorCode.TIMED_OUT, f"{signal}: no confirmation from engines {names} (state change stands)"
            )
        elif result.failed:
            names = ", ".join(f"{engine_id}: {detail}" for engine_id, detail in sorted(result.failed.items()))
            err = WireError(ErrorCode.INTERNAL, f"{signal} failed on engines {names}")
        else:
            await self._reply(incoming, ack)
            return
        self._counters[f"error_{err.code}"] += 1
        log.warning("%s", err.message)
        await self._reply(incoming, error_reply(err))

    async def finish_stop(self) -> None:
        """Every engine confirmed ``stop`` (or had its chance): back to running, ready for new engines."""

        def stopped(current: ControlRecord) -> ControlRecord | None:
            if current.state is not CoordinatorState.STOPPING:
                return None
            return msgspec.structs.replace(
                current, state=CoordinatorState.RUNNING, signal=STOP_DONE, coordinator_id=self._id
            )

        if (await self.shared.change(stopped)).changed:  # else finished already: engines that joined since stay
            await self._forget_engines("stopped")

    async def shut_down_all(self) -> tuple[Written, int]:
        """Raise the shutdown count, which stops every replica of the prefix (this one too);
        returns what was written and how many replicas were alive, this one included."""

        def shutdown(current: ControlRecord) -> ControlRecord:
            return msgspec.structs.replace(
                current, shutdown=current.shutdown + 1, signal=Header.SHUTDOWN.value, coordinator_id=self._id
            )

        replicas = 1 + len(self._peers.live())
        self.fleet_shutdown = True
        return await self.shared.change(shutdown), replicas

    # ------------------------------------------------------------ following the shared record

    def _follow(self, previous: ControlRecord, current: ControlRecord) -> None:
        self.current.copy_from(current)
        self.changed.set()
        if current.state is CoordinatorState.STOPPING and previous.state is not CoordinatorState.STOPPING:
            self._stopping_since = time.monotonic()
        if current.shutdown > previous.shutdown:
            log.info("shutdown signalled through coordinator %s", current.coordinator_id)
            self.fleet_shutdown = True
            self._request_stop()
            return
        stop_over = previous.state is CoordinatorState.STOPPING and current.state is not CoordinatorState.STOPPING
        if stop_over or current.state is CoordinatorState.RUNNING:
            self._spawn(self._settle(stop_over))

    async def _settle(self, stop_over: bool) -> None:
        if stop_over:
            await self._forget_engines("stopped")
        self._ledger.release()

    async def watch_replicas_once(self) -> None:
        """One round of the replica watch (run by :func:`~service.ops.loops.keep_running`): read
        the shared record in case the watch stalled, finish a stop whose replica died, and keep
        replicas without shared state apart."""
        await asyncio.sleep(self._settings.heartbeat_timeout_s / 4)
        if self.failure is not None or not self._nc.is_connected or not self._peers.warmed_up:
            return
        if await self.shared.refresh():
            self._counters["control_state_refreshed"] += 1
        record = self.shared.record
        if (
            record.state is CoordinatorState.STOPPING
            and not self._finishing_stop
            and time.monotonic() - self._stopping_since > 2 * self._settings.control_timeout_s
            and self._peers.should_adopt(record.coordinator_id)
        ):
            self._finishing_stop = True
            self._spawn(self._adopt_stop(self.shared.revision))
        others = self._peers.live()
        if not self.shared.shared and others and self._id > min(others):
            # Replicas that started together both found nobody there: the one with the higher id leaves.
            self.failure = (
                f"coordinator {min(others)} also serves prefix {self._subjects.prefix} and NATS has no JetStream "
                f"to share control state with it, so this one ({self._id}) stops; run one coordinator, or enable "
                "JetStream"
            )
            log.error("%s", self.failure)
            self._request_stop()

    async def _adopt_stop(self, revision: int) -> None:
        """Stop the engines again for the replica that wrote ``stopping`` and died, then finish."""
        try:
            log.warning("finishing the stop coordinator %s began", self.shared.record.coordinator_id)
            await self.broadcast(Header.STOP, EngineSignal(self.current.epoch, revision))
            await self.finish_stop()
        except WireError as err:
            log.warning("could not finish the stop: %s", err.message)
        finally:
            self._finishing_stop = False
