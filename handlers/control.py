"""Handlers for control and profiler signals, broadcast to every engine and acknowledged.

A control signal changes the control state that every coordinator replica of the prefix
shares (service/coordinator/shared_state.py): validated against the transition table on the
record read from the bucket and written with compare-and-set, so the replica that takes it
decides for the whole fleet, and the others follow the record."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from handlers.registry import message_handler
from service.protocol.errors import ErrorCode, WireError
from service.protocol.subjects import Header
from service.protocol.messages import Ack, ControlSignal, EngineSignal, error_reply

if TYPE_CHECKING:
    from service.coordinator.broadcast import BroadcastResult
    from service.coordinator.coordinator import Coordinator, Sender
    from service.coordinator.shared_state import Written

log = logging.getLogger(__name__)


@message_handler(
    Header.PAUSE, Header.UNPAUSE, Header.SUSPEND, Header.RESUME, Header.STOP, Header.SET_GENERATION_EPOCH
)
async def handle_control_signal(coordinator: Coordinator, sender: Sender, payload: ControlSignal) -> None:
    """Sent by an admin: ``{}``, or ``{"epoch": int}`` for set_generation_epoch. Changes the shared
    state as the transition table allows (409 otherwise), broadcasts the signal to every engine
    and answers ``ack`` with the state and revision written once every engine confirmed it; a
    repeat that changes nothing is acked at once."""
    signal = Header(sender.header)
    if signal is Header.SET_GENERATION_EPOCH and payload.epoch is None:
        raise WireError(ErrorCode.MALFORMED, "set_generation_epoch needs an integer epoch")
    written = await coordinator.shared.apply_signal(signal, payload.epoch)
    if not written.changed:
        await coordinator.reply(sender, Ack(signal, state=written.record.state, revision=written.revision))
        return
    log.info("control %s: state %s, revision %d", signal, written.record.state, written.revision)
    coordinator.spawn(_broadcast_and_ack(coordinator, sender, signal, written))


async def _broadcast_and_ack(coordinator: Coordinator, sender: Sender, signal: Header, written: Written) -> None:
    result = await coordinator.broadcast(signal, coordinator.state_signal(written))
    if signal is Header.STOP:
        try:
            await coordinator.finish_stop()
        except WireError as err:
            await coordinator.reply(sender, error_reply(err))
            return
    epoch = written.record.epoch if signal is Header.SET_GENERATION_EPOCH else None
    ack = Ack(signal, state=written.record.state, epoch=epoch, revision=written.revision)
    await _answer(coordinator, sender, signal, result, ack)


@message_handler(Header.START_CUDA_PROFILER, Header.STOP_CUDA_PROFILER)
async def handle_cuda_profiler_signal(coordinator: Coordinator, sender: Sender, payload: ControlSignal) -> None:
    """Forward to every engine; not a state transition, so allowed in any state."""
    signal = Header(sender.header)

    async def broadcast_and_ack() -> None:
        result = await coordinator.broadcast(signal, EngineSignal(payload.epoch))
        details = {engine_id: ack.detail for engine_id, ack in result.acks.items()}
        await _answer(coordinator, sender, signal, result, Ack(signal, state=coordinator.state, engines=details))

    coordinator.spawn(broadcast_and_ack())


async def _answer(coordinator: Coordinator, sender: Sender, signal: Header, result: BroadcastResult, ack: Ack) -> None:
    if result.missing:
        names = ", ".join(sorted(result.missing))
        err = WireError(ErrorCode.TIMED_OUT, f"{signal}: no confirmation from engines {names} (state change stands)")
    elif result.failed:
        names = ", ".join(f"{engine_id}: {detail}" for engine_id, detail in sorted(result.failed.items()))
        err = WireError(ErrorCode.INTERNAL, f"{signal} failed on engines {names}")
    else:
        await coordinator.reply(sender, ack)
        return
    coordinator.counters[f"error_{err.code}"] += 1
    log.warning("%s", err.message)
    await coordinator.reply(sender, error_reply(err))
