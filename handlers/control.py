"""Handlers for control and profiler signals, broadcast to every engine and acknowledged."""

from __future__ import annotations

from handlers.context import ControlContext
from handlers.registry import message_handler
from service.bus.registry import Incoming
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import Ack, ControlSignal
from service.protocol.subjects import CONTROL_HEADERS, PROFILER_HEADERS, Header


@message_handler(*CONTROL_HEADERS)
async def handle_control_signal(coordinator: ControlContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Sent by an admin client: pause, unpause, suspend, resume, stop, or set_generation_epoch
    (whose ``ControlSignal`` carries the ``epoch``; the others may be empty). Pause takes a
    ``mode``: keep (the default: requests in flight freeze and go on after unpause), abort
    (they end with an ``abort`` final and their tokens so far) or drain (the ack waits until
    they finished; new ones are held meanwhile).

    Checked against the transition table on the control state every replica shares (409 when
    it forbids the signal; a repeat that changes nothing is acknowledged at once), written
    there, broadcast to every engine, and answered with an ``Ack`` carrying the new state and
    its revision once every engine confirmed, or an error naming the engines that did not. A
    ``retry`` that finds the state its signal wrote is broadcast again and answered the same
    way, once every engine confirmed."""
    signal = Header(incoming.header)
    if signal is Header.SET_GENERATION_EPOCH and payload.epoch is None:
        raise WireError(ErrorCode.MALFORMED, "set_generation_epoch needs an integer epoch")
    if payload.mode is not None and signal is not Header.PAUSE:
        raise WireError(ErrorCode.MALFORMED, f"mode applies to pause only, not to {signal}")
    written = await coordinator.apply_control(signal, payload)
    if not written.changed and not payload.retry:
        await coordinator.reply(incoming, Ack(signal, state=written.record.state, revision=written.revision))
        return
    coordinator.spawn(coordinator.control_engines(incoming, signal, payload, written))


@message_handler(*PROFILER_HEADERS)
async def handle_cuda_profiler_signal(coordinator: ControlContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Sent by an admin client: start_cuda_profiler or stop_cuda_profiler, empty body.

    Not a state transition, so allowed in any state. Broadcast to every engine; the ``Ack``
    lists each engine's detail (a trace path on CPU engines)."""
    coordinator.spawn(coordinator.control_engines(incoming, Header(incoming.header), payload, None))
