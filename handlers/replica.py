"""Handlers of the messages one coordinator replica sends another (docs/reliability.md,
ownership): each served on ``<prefix>.<header>.<own id>`` (``addressed``), and only
coordinators may publish there (NATS permissions, docs/security.md)."""

from __future__ import annotations

from handlers.context import ReplicaContext
from handlers.registry import message_handler
from service.bus.registry import Incoming
from service.protocol.handover import (
    ArbiterClaims,
    ForwardedAbort,
    ForwardedHold,
    ForwardedSubmission,
    HandedSubmissions,
    Holding,
)
from service.protocol.messages import Ack
from service.protocol.subjects import Header


@message_handler(Header.FORWARD_SUBMISSION, addressed=True)
async def handle_forwarded_submission(
    coordinator: ReplicaContext, incoming: Incoming, payload: ForwardedSubmission
) -> None:
    """Sent by a replica that got a resubmission it does not hold: the client's owner, reply
    subject and body. Answers ``Holding``: held (in flight, or cached: then this replica
    answers the client's reply subject from now on), and whether this replica is settling;
    403 or 409 when it holds the request for another owner or with another body."""
    held = await coordinator.take_resubmission(payload)
    await coordinator.reply(incoming, Holding(held, coordinator.settling))


@message_handler(Header.FORWARD_ABORT, addressed=True)
async def handle_forwarded_abort(coordinator: ReplicaContext, incoming: Incoming, payload: ForwardedAbort) -> None:
    """Sent by a replica that got an abort it cannot apply. Answers as to the client: an ``Ack``
    naming the request, 404 when this replica does not hold it, 403 when another owner does."""
    request_id = await coordinator.abort_held(payload)
    await coordinator.reply(incoming, Ack(Header.ABORT_REQUEST, request_id=request_id))


@message_handler(Header.ARBITER_SUBMISSION, addressed=True, direct=True)
async def handle_arbiter_submission(
    coordinator: ReplicaContext, incoming: Incoming, payload: HandedSubmissions
) -> None:
    """Sent by a replica that took submissions whose ids this replica arbitrates: each client's
    message unchanged, with the client's NATS reply subject. Each is answered as a
    ``submit_request`` sent here is (its refusal to the client), never handed on. No answer."""
    for reply, body in payload.items:
        await coordinator.admit_handed(reply, body)


@message_handler(Header.ARBITER_CLAIMS, addressed=True)
async def handle_arbiter_claims(coordinator: ReplicaContext, incoming: Incoming, payload: ArbiterClaims) -> None:
    """Sent by every replica whenever the replicas it sees change: the ids it holds that this one
    arbitrates, and its view. This replica asks the holder about a copy of one of them before
    running it. No answer."""
    await coordinator.take_claims(payload)


@message_handler(Header.FORWARD_HOLD, addressed=True)
async def handle_forwarded_hold(coordinator: ReplicaContext, incoming: Incoming, payload: ForwardedHold) -> None:
    """Sent by a replica that got a ``hold_request`` for a request it does not hold. Answers as
    to the client: an ``Ack`` naming the request once the hold went to its engine, 404 when
    this replica does not hold it, 403 when another owner does."""
    request_id = await coordinator.hold_held(payload)
    await coordinator.reply(incoming, Ack(Header.HOLD_REQUEST, request_id=request_id))
