"""The engine runtime's handler registry: one decorated function per message an engine receives.

Extension contract: as for the coordinator (:mod:`service.bus.registry`). ``direct=True``
marks messages routed to this engine alone (``<prefix>.engine.<engine_id>.<header>``), handled
on nats-py's reading task; ``fanout=True`` marks broadcasts to every engine
(``<prefix>.engines.<header>``), each answered with an ``EngineAck`` whose detail the handler
returns through :meth:`EngineContext.confirm`. Handlers are typed against
:class:`EngineContext`, all they may ask of the runtime.
"""

from __future__ import annotations

from typing import Protocol

from service.bus.registry import HandlerRegistry, Incoming
from service.protocol.handover import Adoption
from service.protocol.membership import ResendReplies
from service.protocol.messages import (
    ControlSignal,
    EngineAck,
    PauseMode,
    RoutedAbort,
    RoutedRequest,
    RoutedRequestBatch,
    WeightSignal,
)
from service.protocol.subjects import (
    ADOPT,
    COMMIT_WEIGHTS,
    DISCARD_WEIGHTS,
    PREPARE_WEIGHTS,
    RESEND_REPLIES,
    Header,
)


class EngineContext(Protocol):
    async def start_request(self, routed: RoutedRequest) -> None:
        """Hand a routed request to the backend; one it refuses gets an error reply at once."""

    async def abort_request(self, request_id: str) -> None:
        """Stop generating for ``request_id``; its final says ``abort``."""

    async def resend_replies(self, incoming: Incoming, resend: ResendReplies) -> None:
        """Send the named terminal replies again and answer which requests never arrived."""

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


@engine_handler(Header.SUBMIT_REQUEST, direct=True)
async def handle_routed_requests(engine: EngineContext, incoming: Incoming, payload: RoutedRequestBatch) -> None:
    """Sent by the coordinator: every request it routed here in one loop turn, each a return
    path and the client's body. Each starts generating; no answer (replies follow)."""
    for routed in payload.requests:
        await engine.start_request(routed)


@engine_handler(Header.ABORT_REQUEST, direct=True)
async def handle_abort(engine: EngineContext, incoming: Incoming, payload: RoutedAbort) -> None:
    """Sent by the coordinator when a client aborts or a request failed elsewhere: its request
    id. Generation stops; the final says ``abort``."""
    await engine.abort_request(payload.request_id)


@engine_handler(RESEND_REPLIES, direct=True)
async def handle_resend_replies(engine: EngineContext, incoming: Incoming, payload: ResendReplies) -> None:
    """Sent by a coordinator reconciling after lost messages: request ids this engine no longer
    holds. The remembered replies are sent again; the answer lists the ids never received."""
    await engine.resend_replies(incoming, payload)


@engine_handler(Header.PAUSE, fanout=True)
async def handle_pause(engine: EngineContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Broadcast by the coordinator, with ``mode`` keep (or none), abort or drain. Confirmed
    once no step runs, on the accelerator too: a barrier. With ``drain`` only after every
    request in flight finished; with ``abort`` after each ended with an ``abort`` final."""
    await engine.pause(payload.mode)
    await engine.confirm(incoming)


@engine_handler(Header.UNPAUSE, fanout=True)
async def handle_unpause(engine: EngineContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Broadcast by the coordinator. Stepping resumes; confirmed at once."""
    await engine.unpause()
    await engine.confirm(incoming)


@engine_handler(Header.SUSPEND, fanout=True)
async def handle_suspend(engine: EngineContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Broadcast by the coordinator while paused. Confirmed once the backend freed its memory."""
    await engine.suspend()
    await engine.confirm(incoming)


@engine_handler(Header.RESUME, fanout=True)
async def handle_resume(engine: EngineContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Broadcast by the coordinator. Confirmed once the backend restored its memory."""
    await engine.resume()
    await engine.confirm(incoming)


@engine_handler(Header.STOP, fanout=True)
async def handle_stop(engine: EngineContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Broadcast by the coordinator. Every request fails with 503, the confirmation says how
    many, then the engine leaves."""
    detail = await engine.stop_serving()
    await engine.confirm(incoming, detail)
    engine.request_stop()


@engine_handler(Header.SET_GENERATION_EPOCH, fanout=True)
async def handle_set_generation_epoch(engine: EngineContext, incoming: Incoming, payload: ControlSignal) -> None:
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
async def handle_start_profiler(engine: EngineContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Broadcast by the coordinator. The confirmation's detail says what was started."""
    await engine.confirm(incoming, engine.start_profiler())


@engine_handler(Header.STOP_CUDA_PROFILER, fanout=True)
async def handle_stop_profiler(engine: EngineContext, incoming: Incoming, payload: ControlSignal) -> None:
    """Broadcast by the coordinator. The confirmation's detail names the trace written, if any."""
    await engine.confirm(incoming, engine.stop_profiler())


@engine_handler(ADOPT, fanout=True)
async def handle_adopt(engine: EngineContext, incoming: Incoming, payload: Adoption) -> None:
    """Broadcast by the coordinator replica that adopts a dead one's requests: both ids. The
    requests of the dead one name the adopter from now on; the ``EngineAck`` lists them
    (``adopted``: return path, body, partials sent), so the adopter holds them as its own."""
    await engine.hand_over(incoming, payload)
