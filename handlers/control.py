"""Handlers for control and profiler signals, broadcast to every engine and acknowledged."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from handlers.registry import message_handler
from service.protocol.errors import ErrorCode, WireError
from service.protocol.state import CoordinatorState, decide
from service.protocol.subjects import Header
from service.protocol.messages import Ack, ControlSignal, error_reply

if TYPE_CHECKING:
    from service.coordinator.broadcast import BroadcastResult
    from service.coordinator.coordinator import Coordinator, Sender

log = logging.getLogger(__name__)


@message_handler(
    Header.PAUSE, Header.UNPAUSE, Header.SUSPEND, Header.RESUME, Header.STOP, Header.SET_GENERATION_EPOCH
)
async def handle_control_signal(coordinator: Coordinator, sender: Sender, payload: ControlSignal) -> None:
    """Check the signal against the transition table, change state, broadcast, ack when confirmed."""
    signal = Header(sender.header)
    if signal is Header.SET_GENERATION_EPOCH and payload.epoch is None:
        raise WireError(ErrorCode.MALFORMED, "set_generation_epoch needs an integer epoch")
    decision = decide(coordinator.state, signal)
    if not decision.changes:
        await coordinator.reply(sender, Ack(signal, state=coordinator.state))
        return
    coordinator.state = decision.new_state
    if signal is Header.SET_GENERATION_EPOCH:
        coordinator.epoch = payload.epoch
    log.info("control %s: state %s", signal, coordinator.state)
    coordinator.spawn(_broadcast_and_ack(coordinator, sender, signal, payload, decision.new_state))


async def _broadcast_and_ack(
    coordinator: Coordinator, sender: Sender, signal: Header, payload: ControlSignal, new_state: CoordinatorState
) -> None:
    result = await coordinator.broadcast(signal, payload)
    if signal is Header.STOP:
        await coordinator.finish_stop()
    elif signal is Header.UNPAUSE:
        await coordinator.dispatch_held()
    await _answer(coordinator, sender, signal, result, Ack(signal, state=new_state, epoch=payload.epoch))


@message_handler(Header.START_CUDA_PROFILER, Header.STOP_CUDA_PROFILER)
async def handle_cuda_profiler_signal(coordinator: Coordinator, sender: Sender, payload: ControlSignal) -> None:
    """Forward to every engine; not a state transition, so allowed in any state."""
    signal = Header(sender.header)

    async def broadcast_and_ack() -> None:
        result = await coordinator.broadcast(signal, payload)
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
