"""Messages between coordinator replicas, and from the adopter of a dead replica to engines.

A request belongs to the replica that admitted it (its id starts with that replica's id). A
resubmission, an abort or a hold can reach another replica through the queue group; that replica asks
its live peers, each on its own subject (``<prefix>.<header>.<recipient>``), whether they hold
the request, passing along the client's owner and reply subject, which only it saw. Only
coordinators may publish these (NATS permissions, docs/security.md): a forwarded message names
the owner, and the recipient believes it.

When a replica is known dead, the live replica with the lowest id adopts its requests: it
broadcasts :class:`Adoption` to every engine, which hands over the requests of the dead replica
(``EngineAck.adopted``) and from then on names the adopter in their replies.
"""

from __future__ import annotations

from msgspec import Struct

from service.protocol.messages import ClientRequestId


class ForwardedSubmission(Struct, array_like=True):
    """A resubmission the sending replica does not hold: held by the recipient, it answers
    ``reply_to`` from now on (or replays its cached result there)."""

    owner: str
    reply_to: str
    stream: bool
    client_id: str
    client_request_id: ClientRequestId
    body: bytes  # the contract body, compared with the original's


class ForwardedAbort(Struct, array_like=True):
    """An abort the sending replica could not apply: the recipient applies it if it holds the
    request and ``owner`` owns it, and answers as to the client (an ``Ack`` or an error)."""

    owner: str
    request_id: str | None = None
    client_id: str | None = None
    client_request_id: ClientRequestId | None = None


class ForwardedHold(Struct, array_like=True):
    """A ``hold_request`` the sending replica does not hold: the recipient passes it on to the
    request's engine if it holds the request and ``owner`` owns it, and answers as to the client."""

    owner: str
    request_id: str
    held: bool
    seq: int = 0


class Holding(Struct, tag="holding", tag_field="type"):
    """The answer to a forwarded submission: whether the recipient holds it (in flight, or as a
    cached result), and whether it is ``settling``: adopting a dead peer's requests, or missing
    a peer's heartbeats, so that a request it does not hold now may still be one of its own soon."""

    held: bool
    settling: bool = False


class Adoption(Struct):
    """Broadcast to every engine: requests of coordinator ``dead`` now belong to ``adopter``."""

    dead: str
    adopter: str
