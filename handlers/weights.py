"""The handler for weight updates: one checkpoint for the whole fleet, acknowledged."""

from __future__ import annotations

from handlers.context import ControlContext
from handlers.registry import message_handler
from service.bus.registry import Incoming
from service.protocol.messages import UpdateWeights
from service.protocol.subjects import Header


@message_handler(Header.UPDATE_WEIGHTS)
async def handle_update_weights(coordinator: ControlContext, incoming: Incoming, payload: UpdateWeights) -> None:
    """Sent by an admin client (an RL trainer): ``path``, a Hugging Face directory of
    ``*.safetensors`` every engine can read, and the ``version`` its tokens will carry.

    Allowed while paused or suspended (409 otherwise). Every engine loads the checkpoint and
    checks every tensor's name, shape and dtype against its model; only once all of them could
    is the version recorded in the control state every replica shares and swapped in on every
    engine. Answered with an ``Ack`` carrying the version, the checkpoint's digest and the
    record's revision once every engine confirmed; a checkpoint that does not fit is refused
    with 400 naming the first bad tensor, and the fleet keeps its weights. Engines that
    register later load the recorded version before they serve."""
    coordinator.check_weight_update()
    coordinator.spawn(coordinator.update_weights(incoming, payload))
