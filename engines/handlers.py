"""The broadcasts an engine serves: one decorated function per message sent to every engine
on ``<prefix>.engines.<header>`` (control signals, the profiler, weight updates, hand-overs),
each answered with an ``EngineAck``.

Extension contract: as for the coordinator (:mod:`service.bus.registry`); every handler here
is ``fanout=True``. A handler is typed against :class:`EngineContext`, all it may ask of the
runtime, which the wiring (:mod:`engines.runtime`) provides with the jobs' own methods; it
answers through :meth:`EngineContext.confirm` or :meth:`EngineContext.acknowledge`. The guarded
dispatch (:mod:`engines.runtime_dispatch`) decodes the payload, confirms a control signal
older than the last applied without calling its handler, and turns every failure into an
error ack. Messages routed to one engine alone (``<prefix>.engine.<engine_id>.<header>``) are
not here: the request intake serves them (:mod:`engines.runtime_intake`).
"""

from __future__ import annotations

from typing import Protocol

from service.bus.registry import HandlerRegistry, Incoming
from service.protocol.handover import Adoption
from service.protocol.messages import PauseMode
from service.protocol.routed import EngineAck, EngineSignal, WeightSignal
from service.protocol.subjects import ADOPT, COMMIT_WEIGHTS, DISCARD_WEIGHTS, PREPARE_WEIGHTS, Header


class EngineContext(Protocol):
    async def pause(self, mode: PauseMode | None = None) -> None:
        """Stop stepping once the step in progress ends and the accelerator is idle; ``drain``
        first waits for the requests in flight to finish, ``abort`` ends them."""

    async def unpause(self) -> None: ...

    async def suspend(self) -> None:
        """Pause and free the backend's memory (KV cache); requests are kept."""

    async def resume(self) -> None:
        """Restore what suspend freed; still paused."""

    async def stop_serving(self) -> str:
        """Fail every request and stop; the detail says how many failed."""

    def set_epoch(self, epoch: int | None) -> None: ...

    async def prepare_weights(self, signal: WeightSignal) -> EngineAck:
        """Load and check a checkpoint, keeping the current weights; the ack has its digest."""

    def discard_weights(self, signal: WeightSignal) -> None:
        """Free what ``prepare_weights`` staged for that version."""

    async def commit_weights(self, signal: WeightSignal) -> EngineAck:
        """Swap in the staged weights (loading them if this engine missed the prepare)."""

    async def acknowledge(self, incoming: Incoming, ack: EngineAck) -> None:
        """Answer a broadcast with ``ack`` as it is."""

    def start_profiler(self) -> str: ...

    def stop_profiler(self) -> str: ...

    async def hand_over(self, incoming: Incoming, adoption: Adoption) -> None:
        """Name the adopter in the replies of the dead coordinator's requests from now on, and
        answer with an ``EngineAck`` listing them."""

    async def confirm(self, incoming: Incoming, detail: str = "") -> None:
        """Answer a broadcast with a successful ``EngineAck``."""

    def request_stop(self) -> None: ...


ENGINE_HANDLERS: HandlerRegistry[EngineContext] = HandlerRegistry()
engine_handler = ENGINE_HANDLERS.message_handler


@engine_handler(Header.PAUSE, fanout=True)
async def handle_pause(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
    """Broadcast by the coordinator, with ``mode`` keep (or none), abort or drain. Confirmed
    once no step runs, on the accelerator too: a barrier. With ``drain`` only after every
    request in flight finished; with ``abort`` after each ended with an ``abort`` final."""
    await engine.pause(payload.mode)
    await engine.confirm(incoming)


@engine_handler(Header.UNPAUSE, fanout=True)
async def handle_unpause(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
    """Broadcast by the coordinator. Stepping resumes; confirmed at once."""
    await engine.unpause()
    await engine.confirm(incoming)


@engine_handler(Header.SUSPEND, fanout=True)
async def handle_suspend(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
    """Broadcast by the coordinator while paused. Confirmed once the backend freed its memory."""
    await engine.suspend()
    await engine.confirm(incoming)


@engine_handler(Header.RESUME, fanout=True)
async def handle_resume(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
    """Broadcast by the coordinator. Confirmed once the backend restored its memory."""
    await engine.resume()
    await engine.confirm(incoming)


@engine_handler(Header.STOP, fanout=True)
async def handle_stop(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
    """Broadcast by the coordinator. Every request fails with 503, the confirmation says how
    many, then the engine leaves."""
    detail = await engine.stop_serving()
    await engine.confirm(incoming, detail)
    engine.request_stop()


@engine_handler(Header.SET_GENERATION_EPOCH, fanout=True)
async def handle_set_generation_epoch(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
    """Broadcast by the coordinator: the ``epoch`` that tokens generated from now on carry."""
    engine.set_epoch(payload.epoch)
    await engine.confirm(incoming)


@engine_handler(PREPARE_WEIGHTS, fanout=True)
async def handle_prepare_weights(engine: EngineContext, incoming: Incoming, payload: WeightSignal) -> None:
    """Broadcast by the coordinator for ``update_weights``: a checkpoint ``path`` and its
    ``version``. The engine reads it and checks every tensor's name, shape and dtype against its
    model, still serving the old weights; the ack carries the version and the files' digest, or
    code 400 naming the first tensor that does not match."""
    await engine.acknowledge(incoming, await engine.prepare_weights(payload))


@engine_handler(COMMIT_WEIGHTS, fanout=True)
async def handle_commit_weights(engine: EngineContext, incoming: Incoming, payload: WeightSignal) -> None:
    """Broadcast by the coordinator once every engine prepared ``version`` and the fleet's
    record holds it (``revision``). The engine swaps the weights in with no step running; the
    ack carries the version and digest it serves now."""
    await engine.acknowledge(incoming, await engine.commit_weights(payload))


@engine_handler(DISCARD_WEIGHTS, fanout=True)
async def handle_discard_weights(engine: EngineContext, incoming: Incoming, payload: WeightSignal) -> None:
    """Broadcast by the coordinator when an update was refused: what was staged for ``version``
    is freed. Confirmed at once; the coordinator does not wait for it."""
    engine.discard_weights(payload)
    await engine.confirm(incoming)


@engine_handler(Header.START_CUDA_PROFILER, fanout=True)
async def handle_start_profiler(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
    """Broadcast by the coordinator. The confirmation's detail says what was started."""
    await engine.confirm(incoming, engine.start_profiler())


@engine_handler(Header.STOP_CUDA_PROFILER, fanout=True)
async def handle_stop_profiler(engine: EngineContext, incoming: Incoming, payload: EngineSignal) -> None:
    """Broadcast by the coordinator. The confirmation's detail names the trace written, if any."""
    await engine.confirm(incoming, engine.stop_profiler())


@engine_handler(ADOPT, fanout=True)
async def handle_adopt(engine: EngineContext, incoming: Incoming, payload: Adoption) -> None:
    """Broadcast by the coordinator replica that adopts a dead one's requests: both ids. The
    requests of the dead one name the adopter from now on; the ``EngineAck`` lists them
    (``adopted``: return path, body, partials sent), so the adopter holds them as its own."""
    await engine.hand_over(incoming, payload)
