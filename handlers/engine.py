"""Handlers for engine messages (register, heartbeat, engine_reply(_partial), disconnect) and
for heartbeats between coordinator replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING

from handlers.registry import message_handler
from service.protocol.subjects import Header
from service.protocol.codec import encode_msgpack
from service.protocol.messages import (
    CoordinatorHeartbeat,
    EngineDisconnect,
    EngineRegister,
    EngineReplyBatch,
    Heartbeat,
    RegisterAck,
)

if TYPE_CHECKING:
    from service.coordinator.coordinator import Coordinator, Sender


@message_handler(Header.REGISTER)
async def handle_register(coordinator: Coordinator, sender: Sender, payload: EngineRegister) -> None:
    """Add an engine with zero load; one registering again had restarted, so its old work is lost."""
    if coordinator.engines.get(payload.engine_id) is not None:
        await coordinator.remove_engine(payload.engine_id, "registered again")
    coordinator.add_engine(payload.engine_id, payload.capacity)
    if sender.reply:
        ack = RegisterAck(coordinator.id, coordinator.state, coordinator.epoch)
        await coordinator.nc.publish(sender.reply, encode_msgpack(ack))
    await coordinator.dispatch_held()


@message_handler(Header.HEARTBEAT)
async def handle_heartbeat(coordinator: Coordinator, sender: Sender, payload: Heartbeat) -> None:
    """Refresh liveness; an unknown engine (say, after a coordinator restart) is adopted."""
    record = coordinator.engines.get(payload.engine_id)
    if record is None and coordinator.engines.recently_departed(payload.engine_id):
        return
    if record is None:
        coordinator.add_engine(payload.engine_id, payload.capacity)
        await coordinator.dispatch_held()
        return
    coordinator.engines.heard(record)
    active = set(payload.active)
    if not record.reconciling and not record.requests <= active:
        coordinator.spawn(coordinator.reconcile(record, active))


@message_handler(Header.ENGINE_REPLY)
async def handle_engine_reply(coordinator: Coordinator, sender: Sender, payload: EngineReplyBatch) -> None:
    """Deliver terminal replies; each carries its own route, so nothing is looked up to answer."""
    for reply in payload.replies:
        await coordinator.on_final(payload.engine_id, reply)
    await coordinator.dispatch_held()


@message_handler(Header.ENGINE_REPLY_PARTIAL)
async def handle_engine_reply_partial(coordinator: Coordinator, sender: Sender, payload: EngineReplyBatch) -> None:
    """Relay streamed tokens without releasing the request."""
    for reply in payload.replies:
        await coordinator.on_partial(payload.engine_id, reply)


@message_handler(Header.DISCONNECT)
async def handle_disconnect(coordinator: Coordinator, sender: Sender, payload: EngineDisconnect) -> None:
    """Remove a departing engine from the pool."""
    await coordinator.remove_engine(payload.engine_id, payload.reason or "disconnected")


@message_handler(Header.COORDINATOR_HEARTBEAT)
async def handle_coordinator_heartbeat(coordinator: Coordinator, sender: Sender, payload: CoordinatorHeartbeat) -> None:
    """Track live replicas, so replies of a dead one are delivered by exactly one survivor."""
    coordinator.peers.saw(payload.coordinator_id)
