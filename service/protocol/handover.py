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
    """A submission the sending replica does not hold (a resubmission, or one whose id another
    replica claims): held by the recipient, it answers ``reply_to`` from now on (or replays its
    cached result there). ``client_id`` is None for an anonymous client's id in flight."""

    owner: str
    reply_to: str
    stream: bool
    client_id: str | None
    client_request_id: ClientRequestId
    body: bytes  # the contract body, compared with the original's


class ForwardedAbort(Struct, array_like=True):
    """An abort the sending replica could not apply: the recipient applies it if it holds the
    request and ``owner`` owns it, and answers as to the client (an ``Ack`` or an error)."""

    owner: str
    request_id: str | None = None
    client_id: str | None = None
    client_request_id: ClientRequestId | None = None


class HandedSubmissions(Struct, array_like=True):
    """Submissions whose ids the recipient arbitrates (:mod:`service.protocol.arbiter`), each
    as its client sent it: the client's NATS reply subject ("" when it gave none) and the
    message body. The recipient answers each as a ``submit_request`` and never hands one on."""

    items: list[tuple[str, bytes]]


class ArbiterClaims(Struct, array_like=True):
    """The ids ``holder`` holds (in flight, or as a cached result) that the recipient arbitrates
    in ``view``, the replicas as ``holder`` sees them: sent to every replica whenever that view
    changes, in parts under ``max_payload`` (``part`` from 0; ``last`` ends them). They replace
    what ``holder`` claimed before. A recipient whose own view is ``view`` and who has every
    replica's claims for it is settled: it runs the ids it arbitrates (docs/reliability.md)."""

    holder: str
    view: list[str]
    keys: list[tuple[str | None, ClientRequestId]]
    part: int = 0
    last: bool = True


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
