"""Handlers for client messages: connect, submit_request, abort_request, hold_request,
list_models, shutdown."""

from __future__ import annotations

import uuid

from handlers.context import ClientContext
from handlers.registry import message_handler
from service.bus.registry import Incoming
from service.protocol import PROTOCOL_VERSION
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import (
    AbortRequest,
    Ack,
    ConnectAck,
    ConnectRequest,
    Empty,
    HoldRequest,
    ModelList,
    SubmitEnvelope,
    SubmitRequest,
)
from service.protocol.subjects import Header


@message_handler(Header.CONNECT, fanout=True)
async def handle_connect(coordinator: ClientContext, incoming: Incoming, payload: ConnectRequest) -> None:
    """Sent by a client once, optionally, with the ``client_id`` it wants (or none).

    Every replica sees it (``fanout``) and remembers the owner of its reply subject as a
    connected client (see ``shutdown``); each answers a ``ConnectAck``, of which a requester
    reads the first: the client id to use (a fresh one when none was given), the coordinator's
    id and the protocol version."""
    coordinator.client_connected(incoming)
    client_id = payload.client_id or f"client-{uuid.uuid4().hex[:12]}"
    await coordinator.reply(incoming, ConnectAck(client_id, coordinator.id, PROTOCOL_VERSION))


@message_handler(Header.SUBMIT_REQUEST, direct=True, per_replica=True)
async def handle_submit_request(
    coordinator: ClientContext, incoming: Incoming, payload: SubmitRequest | SubmitEnvelope
) -> None:
    """Sent by a client: a prompt and sampling parameters (``SubmitRequest``, JSON or msgpack),
    or the client library's ``SubmitEnvelope`` (routing fields plus the body, undecoded).

    Also served on ``submit_request.<coordinator_id>``, where the client library sends a
    named submission to the replica arbitrating its id (service/protocol/arbiter.py); a
    replica that does not arbitrate it hands it to the one that does. Routed to an engine, or
    queued while paused or while every engine is full; the engine's
    partials (when ``stream``) and exactly one final or error reach ``reply_to`` (else the NATS
    reply subject). Refusals answer an error: 400 malformed, 409 duplicate id (or one in
    progress for another reply subject), 413 too large,
    429 queue full, 503 no engine. The envelope's body is validated by the engine, so the
    coordinator never decodes a prompt."""
    await coordinator.admit(incoming, payload)


@message_handler(Header.ABORT_REQUEST)
async def handle_abort_request(coordinator: ClientContext, incoming: Incoming, payload: AbortRequest) -> None:
    """Sent by a client: ``request_id``, or ``client_id`` and ``client_request_id``, with a reply
    subject under the same inbox prefix as the request's (its owner).

    The request ends with a final whose finish reason is ``abort``; the sender gets an ``Ack``
    naming the request id, 404 when no such request is in flight, 403 when it is another
    owner's."""
    if payload.request_id is not None:
        request_id = await coordinator.abort(incoming, payload.request_id, None)
    elif payload.client_request_id is not None:
        request_id = await coordinator.abort(incoming, None, (payload.client_id, payload.client_request_id))
    else:
        raise WireError(ErrorCode.MALFORMED, "abort_request needs request_id or client_request_id")
    await coordinator.reply(incoming, Ack(Header.ABORT_REQUEST, request_id=request_id))


@message_handler(Header.HOLD_REQUEST)
async def handle_hold_request(coordinator: ClientContext, incoming: Incoming, payload: HoldRequest) -> None:
    """Sent by a client whose reader fell behind a stream (an extension; the client library
    sends it, service/client/flow.py): ``request_id``, ``held`` (false releases it) and ``seq``,
    with a reply subject under the same inbox prefix as the request's (its owner).

    Passed on to the request's engine, which stops stepping it while held; the sender gets an
    ``Ack`` naming the request id, 404 when no such request is in flight, 403 when it is
    another owner's."""
    request_id = await coordinator.hold(incoming, payload)
    await coordinator.reply(incoming, Ack(Header.HOLD_REQUEST, request_id=request_id))


@message_handler(Header.LIST_MODELS)
async def handle_list_models(coordinator: ClientContext, incoming: Incoming, payload: Empty) -> None:
    """Sent by a client (the HTTP gateway's ``/v1/models``), with an empty body.

    Answers a ``ModelList``: the models this replica's engines serve, each with its engine
    count, capacity and requests in flight."""
    await coordinator.reply(incoming, ModelList(coordinator.served_models()))


@message_handler(Header.SHUTDOWN)
async def handle_shutdown(coordinator: ClientContext, incoming: Incoming, payload: Empty) -> None:
    """Sent by an admin client, with an empty body, from an inbox prefix that sent ``connect``
    (403 otherwise: a known client, besides the NATS permissions that reserve it to the admin).

    Stops every coordinator replica of the prefix: answers an ``Ack`` with the state and
    ``replicas``, how many there were, then each replica stops; every open request gets an
    error reply on the way out."""
    await coordinator.shut_down(incoming)
