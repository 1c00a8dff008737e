"""Routed messages between coordinator replicas and engines: a request as routed to an engine
with its return path, its replies, control and weight signals, acknowledgements and adoption.

They travel as msgpack only, between dpcoord processes; the ``array_like`` ones as msgpack arrays,
so their field names are not part of the wire contract (docs/protocol.md, *Engines*). The
client-facing bodies are :mod:`service.protocol.messages`.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from service.protocol.logprobs import StreamedLogprobs
from service.protocol.messages import (
    ClientRequestId,
    PauseMode,
    TokenId,
    WeightVersion,
)


class ReturnPath(Struct, array_like=True, gc=False):
    """Everything needed to answer a client, carried with the request, so that a reply does not
    depend on one coordinator's memory.

    Routed messages hold only strings, numbers and bytes, never cycles, so they are kept out
    of the garbage collector's sweeps (``gc=False``): one is alive per request in flight."""

    request_id: str
    coordinator_id: str
    reply_to: str
    encoding: str
    stream: bool
    client_request_id: ClientRequestId | None
    client_id: str | None = None
    batched: bool = False  # replies may go in reply batches (service/protocol/reply_batches.py)


class RoutedRequest(Struct, array_like=True, gc=False):
    """A client's submission as routed to one engine: its return path plus the untouched body.

    Extensions (exact streams): ``attempt`` is the run this routing starts (0 first, one more
    per migration or retry), stamped on its partials and replies. ``resume_tokens`` are tokens
    an earlier run already generated and streamed: the engine continues after them, as if it had
    generated them itself (its partials start at offset ``len(resume_tokens)``, its final
    includes them, ``max_tokens`` and stop strings count them). ``resume_logprobs`` (an
    extension, log-probabilities): theirs, as delivered, when the request asked for them."""

    return_path: ReturnPath
    body: bytes
    attempt: int = 0
    resume_tokens: list[TokenId] | None = None
    resume_logprobs: StreamedLogprobs | None = None


class FirstRun(Struct, array_like=True, gc=False):
    """A routed request's first run, encoded as earlier releases did (``[route, body]``): with
    nothing to resume, it leaves out :class:`RoutedRequest`'s extensions, so the engines of
    earlier releases that read exactly two elements keep working for every first run."""

    return_path: ReturnPath
    body: bytes


class RoutedRequestBatch(Struct, array_like=True):
    """Every request routed to one engine in one event-loop turn: one NATS message for many."""

    requests: list[RoutedRequest]


class RoutedRequestsOut(Struct, array_like=True):
    """A :class:`RoutedRequestBatch` as the coordinator encodes it: first runs as
    :class:`FirstRun`, retries and migrations as :class:`RoutedRequest` (encode only)."""

    requests: list[FirstRun | RoutedRequest]


class RoutedAbort(Struct):
    request_id: str


class RoutedHold(Struct):
    """A :class:`HoldRequest` the request's owner passes on to its engine
    (``<prefix>.engine.<id>.hold_request``): the engine skips the request in its steps while
    held, keeping it; unknown request ids and a ``seq`` not newer than the last applied are
    ignored. An engine of an earlier release does not listen there and keeps generating."""

    request_id: str
    held: bool
    seq: int = 0


class RoutedReply(Struct, array_like=True, gc=False):
    """One reply, already encoded for its client, with the return path to deliver it.

    ``seq`` orders a stream across the two engine subjects: a partial's index, or for a final
    the number of partials sent before it, so the coordinator never delivers a final ahead of
    a partial still in flight on the other subject.

    Extensions (exact streams): ``tokens`` are a streamed partial's token ids, so the
    coordinator keeps what was streamed without decoding the client's body (None for other
    replies, and from engines of earlier releases: that stream cannot migrate); ``attempt`` is
    the run of the :class:`RoutedRequest` it answers, so replies of an older run are dropped.
    ``logprobs`` (an extension): a streamed partial's log-probabilities, when its request asked
    for them, kept with its tokens.
    """

    return_path: ReturnPath
    body: bytes
    seq: int = 0
    tokens: list[TokenId] | None = None
    attempt: int = 0
    logprobs: StreamedLogprobs | None = None


class EngineReplyBatch(Struct):
    engine_id: str
    replies: list[RoutedReply]


class EngineSignal(Struct):
    """A control or profiler signal as broadcast to engines (``<prefix>.engines.<signal>``).

    ``revision`` is the control-state revision the signal wrote. Replicas broadcast their
    signals independently, so two may reach an engine in the opposite order; an engine
    applies a state change only when its revision is newer than the last it applied, which
    leaves every engine in the state of the highest revision. None (profiler signals, or
    a coordinator without shared state) is applied unconditionally."""

    epoch: int | None = None
    revision: int | None = None
    mode: PauseMode | None = None  # pause only


class WeightSignal(Struct):
    """``prepare_weights`` and ``commit_weights`` as broadcast to engines: the checkpoint
    directory and its version. Commit only: ``revision`` is the control-state revision that
    recorded the version (an engine commits only a revision newer than the one its weights came
    from), ``digest`` the one every engine prepared (an engine already serving that version
    with that digest has nothing to swap)."""

    path: str
    version: WeightVersion
    revision: int | None = None
    digest: str | None = None


class EngineAck(Struct):
    """An engine's confirmation of a broadcast control or profiler signal. For the weight
    phases, ``weight_version`` and ``digest`` say what it loaded, and ``code`` why it could not
    (400: the checkpoint does not match its model)."""

    engine_id: str
    signal: str
    ok: bool = True
    detail: str = ""
    weight_version: WeightVersion | None = None
    digest: str | None = None
    code: int | None = None
    # An extension, answering ``adopt`` alone: the requests this engine handed to the adopter.
    adopted: list[AdoptedRequest] | None = None


class AdoptedRequest(Struct, array_like=True, gc=False):
    """One request of a dead coordinator replica, as its engine hands it to the adopter: the
    return path (already naming the adopter), the client's body (so it can be routed again),
    how many partials the engine has sent (the ``seq`` its next reply carries), the tokens it
    generated so far (a migration resumes after them) and the run (``attempt``) it is; for a
    request that asked for log-probabilities, ``logprobs``: those of its tokens (none for one
    that asked for its prompt's only)."""

    return_path: ReturnPath
    body: bytes
    partials_sent: int
    tokens: list[TokenId] = msgspec.field(default_factory=list)
    attempt: int = 0
    logprobs: StreamedLogprobs | None = None
