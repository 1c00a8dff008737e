"""Handlers for engine messages (register, heartbeat, engine_reply(_partial), disconnect,
kv_events) and
for heartbeats between coordinator replicas. Every replica must see these (``fanout``).
Engine messages are handled on the reading task (``direct``): replies are the hot path, and a
fleet of thousands registers and heartbeats thousands of times a second.

Engines send on ``<prefix>.<header>.<engine_id>`` (``per_sender``): NATS permissions can let
each engine publish only there, and the engine a message is from is the one its subject names.
A body naming another engine is refused (403), so no engine speaks for another; a reply is
then relayed only if its request was routed to that engine (docs/security.md). Engines of
earlier releases send on the plain ``<prefix>.<header>``, still served: there the body names
the engine, except one that registered on its own subjects, for which such a message gets 403.
"""

from __future__ import annotations

from handlers.context import EngineContext
from handlers.registry import message_handler
from service.bus.registry import Incoming
from service.protocol.kv_events import KvEvents
from service.protocol.membership import (
    CoordinatorHeartbeat,
    EngineDisconnect,
    EngineRegister,
    Heartbeat,
    computes_logprobs,
)
from service.protocol.routed import EngineReplyBatch
from service.protocol.subjects import Header


@message_handler(Header.REGISTER, fanout=True, direct=True, per_sender=True)
async def handle_register(coordinator: EngineContext, incoming: Incoming, payload: EngineRegister) -> None:
    """Sent by an engine when it starts: its ``engine_id``, ``capacity``, ``served_model_name`` and
    ``features`` (msgpack).

    The engine joins with zero load, serving that model (requests asking for log-probabilities
    only when it announces them); one registering again had restarted,
    so its old work is lost. Answers a ``RegisterAck`` with the control state and epoch to start
    in, and the fleet's weights: an engine that serves other ``weight_version`` is not added,
    it loads those and registers again; 400 for an id that cannot be a subject token, 403 for another engine's id (see above),
    429 when the pool holds ``max_engines``. An engine with ``kv_sequence`` publishes KV events:
    it is asked for a snapshot of its prefix cache (``cache_aware`` routing)."""
    engine_id = coordinator.engine_sender(incoming, payload.engine_id)
    await coordinator.register_engine(
        incoming,
        engine_id,
        payload.capacity,
        payload.served_model_name,
        payload.weight_version,
        payload.kv_sequence,
        computes_logprobs(payload.features),
    )


@message_handler(Header.HEARTBEAT, fanout=True, direct=True, per_sender=True)
async def handle_heartbeat(coordinator: EngineContext, incoming: Incoming, payload: Heartbeat) -> None:
    """Sent by every engine each ``heartbeat_interval_s``: its load, the request ids it holds and
    the steps it has taken.

    Refreshes liveness and progress; an unknown engine (say, after a coordinator restart) is
    adopted. Requests the engine no longer holds are reconciled. No answer."""
    coordinator.engine_sender(incoming, payload.engine_id)
    await coordinator.engine_heartbeat(payload, own_subjects=incoming.sender is not None)


@message_handler(Header.ENGINE_REPLY, fanout=True, direct=True, per_sender=True)
async def handle_engine_reply(coordinator: EngineContext, incoming: Incoming, payload: EngineReplyBatch) -> None:
    """Sent by an engine after each step: terminal replies (finals and errors), each already
    encoded for its client and carrying its own return path.

    Each is sent to its client, and its engine slot freed, if its request was routed to this
    engine. No answer."""
    await coordinator.relay_finals(coordinator.engine_sender(incoming, payload.engine_id), payload.replies)


@message_handler(Header.ENGINE_REPLY_PARTIAL, fanout=True, direct=True, per_sender=True)
async def handle_engine_reply_partial(
    coordinator: EngineContext, incoming: Incoming, payload: EngineReplyBatch
) -> None:
    """Sent by an engine after each step: streamed tokens of requests with ``stream``.

    Each is sent to its client in order, if its request was routed to this engine; the requests
    stay open. No answer."""
    await coordinator.relay_partials(coordinator.engine_sender(incoming, payload.engine_id), payload.replies)


@message_handler(Header.DISCONNECT, fanout=True, direct=True, per_sender=True)
async def handle_disconnect(coordinator: EngineContext, incoming: Incoming, payload: EngineDisconnect) -> None:
    """Sent by an engine that leaves: its ``engine_id`` and a reason.

    The engine is dropped: requests it had not streamed are routed again, the rest fail with
    503. No answer."""
    await coordinator.remove_engine(
        coordinator.engine_sender(incoming, payload.engine_id), payload.reason or "disconnected"
    )


@message_handler(Header.KV_EVENTS, fanout=True, direct=True, per_sender=True)
async def handle_kv_events(coordinator: EngineContext, incoming: Incoming, payload: KvEvents) -> None:
    """Sent by an engine with a prefix cache after each step that changed what it holds (or the
    prompt tokens waiting for their prefill): the prefixes stored and evicted, numbered by
    ``sequence`` (docs/protocol.md, *KV events*).

    Applied to this replica's block index in their numbering; a gap asks the engine for a
    snapshot. Dropped unread unless ``routing_policy`` is ``cache_aware``. No answer."""
    coordinator.kv_events(coordinator.engine_sender(incoming, payload.engine_id), payload)


@message_handler(Header.COORDINATOR_HEARTBEAT, fanout=True)
async def handle_coordinator_heartbeat(
    coordinator: EngineContext, incoming: Incoming, payload: CoordinatorHeartbeat
) -> None:
    """Sent by every coordinator replica each ``heartbeat_interval_s``: its id.

    Tracks live replicas, so that replies of a dead one are delivered by exactly one
    survivor, and those that arbitrate request ids (``arbitrates``). No answer. With a reply subject it is a replica without JetStream asking, before
    it subscribes, whether another one serves the prefix: answered with this replica's
    heartbeat, and not counted as a heartbeat of the asker. A ``leaving`` beat is the last of a
    replica that stops: its requests are adopted at once."""
    if incoming.reply:
        await coordinator.reply(incoming, CoordinatorHeartbeat(coordinator.id))
        return
    coordinator.peer_seen(payload.coordinator_id, payload.leaving, payload.arbitrates)
