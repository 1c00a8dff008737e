"""Handlers for client messages: connect, submit_request, abort_request, shutdown."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from handlers.registry import message_handler
from service.protocol import PROTOCOL_VERSION
from service.protocol.errors import ErrorCode, WireError
from service.protocol.subjects import Header
from service.protocol.messages import (
    AbortRequest,
    Ack,
    ConnectAck,
    ConnectRequest,
    Empty,
    SubmitEnvelope,
    SubmitRequest,
)

if TYPE_CHECKING:
    from service.coordinator.coordinator import Coordinator, Sender


@message_handler(Header.CONNECT)
async def handle_connect(coordinator: Coordinator, sender: Sender, payload: ConnectRequest) -> None:
    """Hand out a client id and the protocol version; optional for clients."""
    client_id = payload.client_id or f"client-{uuid.uuid4().hex[:12]}"
    await coordinator.reply(sender, ConnectAck(client_id, coordinator.id, PROTOCOL_VERSION))


@message_handler(Header.SUBMIT_REQUEST)
async def handle_submit_request(coordinator: Coordinator, sender: Sender, payload: SubmitRequest | SubmitEnvelope) -> None:
    """Route a client request to an engine, or hold it while paused or while every engine is full.

    A plain body is validated whole here; the client library's envelope is routed by its own
    fields and its body is validated by the engine, so the coordinator never decodes a prompt."""
    await coordinator.admit(sender, payload)


@message_handler(Header.ABORT_REQUEST)
async def handle_abort_request(coordinator: Coordinator, sender: Sender, payload: AbortRequest) -> None:
    """Cancel a request by ``request_id`` or by ``(client_id, client_request_id)``; its final says ``abort``."""
    if payload.request_id is not None:
        entry = coordinator.requests.get(payload.request_id)
        wanted = f"request_id {payload.request_id!r}"
    elif payload.client_request_id is not None:
        entry = coordinator.requests.find_client((payload.client_id, payload.client_request_id))
        wanted = f"client_request_id {payload.client_request_id!r} of client_id {payload.client_id!r}"
    else:
        raise WireError(ErrorCode.MALFORMED, "abort_request needs request_id or client_request_id")
    if entry is None:
        raise WireError(ErrorCode.NOT_FOUND, f"no request in flight with {wanted}")
    await coordinator.abort(entry)
    await coordinator.reply(sender, Ack(Header.ABORT_REQUEST, request_id=entry.route.request_id))


@message_handler(Header.SHUTDOWN)
async def handle_shutdown(coordinator: Coordinator, sender: Sender, payload: Empty) -> bool:
    """Sent by an admin: ``{}``. Stops every coordinator replica of the prefix (each answers its
    open requests with an error on the way out); the ``ack`` says how many replicas there were."""
    written, replicas = await coordinator.shutdown_all()
    ack = Ack(Header.SHUTDOWN, state=written.record.state, revision=written.revision, replicas=replicas)
    await coordinator.reply(sender, ack)
    await coordinator.nc.flush()
    return True
