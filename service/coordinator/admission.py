"""Admission: accepting a submission, or refusing it with a code.

Contract:
- A submission is refused before it is accepted (400 bad reply subject, id too long, deadline
  beyond ``max_request_timeout_s``; 403 a resubmission from another owner; 404 a model no engine
  serves; 409 an anonymous client's id already in flight, a resubmission with another body, or
  one in flight for another reply subject;
  429 queue full, by count or bytes; 503 no engine), or accepted: then it holds a deadline (504
  when it passes) and ends with exactly one terminal reply (see the relay).
- Replies go only to inboxes: ``reply_to`` must be under an inbox prefix, and under the same one
  as the message's NATS reply subject when it has one. That prefix owns the request.
- A named client's repeated ``(client_id, client_request_id)`` is answered, never run twice,
  when it comes from the same owner with the same body: a request in flight goes on answering
  its reply subject (a repeat on another reply subject gets 409 ``in progress``, so no inbox
  is left silent), a cached result is sent again. Across replicas, the arbiter of the id
  alone admits it (:mod:`.arbitration`).
- A submission naming a ``model`` goes only to engines serving it (the pool's group for it);
  one that names a model no engine serves is refused with 404. One asking for
  log-probabilities goes only to engines that announce them; 503 when none of its group does.
- Accepted requests enter the ledger (:mod:`.ledger`), routed at once while the coordinator
  runs, an engine (serving their model) has room and none of their model waits; otherwise they
  wait in the queue of their model (owners in turn, :mod:`.fair_queue`) until the ledger
  releases it. A replica that has not yet heard the fleet (one heartbeat timeout after it
  starts) queues rather than answering 503 or 404.
- Request ids are random (:mod:`service.coordinator.request_ids`).
- A submission whose client reads reply batches (``SubmitEnvelope.batched_replies``) has its
  replies batched (:mod:`service.protocol.reply_batches`) when its batch subject is one replies
  may go to, under the request's owner; else they go alone.
- A submission that asks for it (``SubmitEnvelope.held_notices``) and is queued because the
  fleet is not running (paused, suspended) is told so at once with a ``Held`` notice, alone on
  its reply subject, before any other reply.
- With tracing on (:mod:`service.ops.tracing`), the coordinator admits through
  :meth:`Admission.admit_traced`: an accepted request continues the ``traceparent`` of its NATS
  headers (or starts a trace) and carries its spans in the ledger. :meth:`Admission.admit`
  itself has no tracing in it, so tracing off costs admission nothing.
"""

from __future__ import annotations

import logging
import time

from service.bus.registry import Incoming
from service.coordinator.answers import Answers
from service.coordinator.core import Core
from service.coordinator.ledger import RequestLedger, no_logprobs_engine, unknown_model
from service.coordinator.peers import CoordinatorPeers
from service.coordinator.pool import EngineGroup, EnginePool
from service.coordinator.request_ids import request_ids
from service.coordinator.requests import ClientKey, InflightRequest
from service.coordinator.results import body_digest
from service.ops.tracing import traceparent_in
from service.protocol.codec import detect_encoding, encode
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import ForwardedSubmission
from service.protocol.messages import ClientRequestId, Held, SubmitEnvelope, SubmitRequest
from service.protocol.reply_batches import batch_subject
from service.protocol.routed import ReturnPath
from service.protocol.subjects import ReplySubjects, utf8_length

log = logging.getLogger(__name__)


class Admission:
    def __init__(
        self,
        core: Core,
        ledger: RequestLedger,
        answers: Answers,
        pool: EnginePool,
        peers: CoordinatorPeers,
        replies: ReplySubjects,
    ) -> None:
        settings = core.settings
        self._id = core.id
        self._nc = core.nc
        self._tracer = core.tracer
        self._settings = settings
        self._counters = core.counters
        self._ledger = ledger
        self._answers = answers
        self._pool = pool
        self._peers = peers
        self._replies = replies
        self._ids = request_ids(core.id)
        self._max_id = settings.max_id_bytes
        self._short_id = settings.max_id_bytes // 4  # a character takes at most 4 bytes in UTF-8
        self._max_timeout = settings.max_request_timeout_s
        self._shared_inbox = replies.inboxes.first[1]

    async def admit_traced(self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope) -> None:
        """:meth:`admit`, and the spans of the request it accepted, when its trace is sampled."""
        started_ns = time.time_ns()
        entry = await self.admit(incoming, submit)
        admitted_ns = time.time_ns()
        tracer = self._tracer
        if entry is None or tracer is None:
            return
        trace = tracer.coordinator_request(traceparent_in(incoming.headers), started_ns)
        if trace is not None:
            entry.trace = trace
            trace.admitted(entry.return_path.request_id, self._id, entry.model, entry.engine_id is None, admitted_ns)

    async def admit(self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope) -> InflightRequest | None:
        """Route or queue a submission; the request it accepted (None: none, a resubmission
        answered or a submission without a reply subject). An envelope's body is forwarded
        undecoded (the engine validates it)."""
        if submit.reply_to is None:
            reply_to, owner = incoming.reply, incoming.owner
        else:
            reply_to, owner = self._reply_subject(incoming, submit.reply_to)
        if reply_to is None or owner is None:
            self._counters["submit_without_reply"] += 1
            log.warning("submission without reply subject dropped (client_request_id=%s)", submit.client_request_id)
            return None
        if isinstance(submit, SubmitEnvelope):
            body, encoding, timeout_s = submit.body, detect_encoding(submit.body), submit.timeout_s
            logprobs = submit.logprobs
        else:
            body, encoding, timeout_s = incoming.body, incoming.encoding, submit.sampling_params.timeout_s
            logprobs = submit.sampling_params.asks_logprobs
        client_request_id, client_id = submit.client_request_id, submit.client_id
        short = self._short_id  # ids at most this many characters fit max_id_bytes whatever they hold: no check
        if (isinstance(client_request_id, str) and len(client_request_id) > short) or (
            client_id is not None and len(client_id) > short
        ):
            self._check_ids(client_request_id, client_id)
        if timeout_s is not None and not timeout_s <= self._max_timeout:  # also catches NaN
            raise WireError(
                ErrorCode.MALFORMED, f"timeout_s {timeout_s} exceeds max_request_timeout_s ({self._max_timeout:g})"
            )
        client_key = None
        if submit.client_request_id is not None:
            client_key = (submit.client_id, submit.client_request_id)
            if await self.resubmitted(client_key, reply_to, submit.stream, owner, body):
                return None
        ledger = self._ledger
        if len(self._pool) == 0 and ledger.running and self._peers.warmed_up:
            raise WireError(ErrorCode.NO_ENGINE, "no engine available")
        model = submit.model
        group = self._pool.everyone if model is None else self._engines_serving(model)
        key = ledger.routing_key(submit)
        if logprobs and group is not None and not group.computing_logprobs and self._peers.warmed_up:
            raise no_logprobs_engine(model)
        engine = ledger.engine_for(group, model, key, logprobs)
        if engine is None:
            settings = self._settings
            if ledger.queued >= settings.max_queued_requests:
                raise WireError(ErrorCode.OVERLOADED, f"coordinator queue full ({settings.max_queued_requests} held)")
            if ledger.queued_bytes + len(body) > settings.max_queued_bytes:
                raise WireError(
                    ErrorCode.OVERLOADED, f"coordinator queue full ({settings.max_queued_bytes} bytes held)"
                )

        request_id = next(self._ids)
        batched = isinstance(submit, SubmitEnvelope) and submit.batched_replies and self._batches(reply_to, owner)
        return_path = ReturnPath(
            request_id,
            self._id,
            reply_to,
            encoding.value,
            submit.stream,
            submit.client_request_id,
            submit.client_id,
            batched,
        )
        entry = InflightRequest(
            return_path, encoding, body, client_key, model=model, owner=owner, routing_key=key, logprobs=logprobs
        )
        ledger.admit(entry, timeout_s, engine)
        if engine is None and not ledger.running and type(submit) is SubmitEnvelope and submit.held_notices:
            held = Held(request_id, submit.client_request_id, ledger.state)
            await self._nc.publish(reply_to, encode(held, encoding))
        return entry

    def holds(self, client_key: ClientKey) -> bool:
        """Whether this replica holds ``client_key``'s request, in flight or as a cached result."""
        return self._ledger.find_client(client_key) is not None or self._answers.cached(client_key) is not None

    def forwardable(self, incoming: Incoming, submit: SubmitEnvelope) -> ForwardedSubmission | None:
        """A resubmission of a named client that this replica does not hold, as its peers are
        asked about it; None for anything admit should handle at once (refusals included)."""
        if not submit.resubmission or submit.client_id is None or submit.client_request_id is None:
            return None
        if self.holds((submit.client_id, submit.client_request_id)):
            return None
        return self.as_forwarded(incoming, submit)

    def as_forwarded(self, incoming: Incoming, submit: SubmitRequest | SubmitEnvelope) -> ForwardedSubmission | None:
        """A named submission as its holder is asked about it (``forward_submission``); None when
        it names no client or no usable reply subject (admit refuses it)."""
        client_id, client_request_id = submit.client_id, submit.client_request_id
        if client_request_id is None:
            return None
        try:
            reply_to, owner = (
                (incoming.reply, incoming.owner)
                if submit.reply_to is None
                else self._reply_subject(incoming, submit.reply_to)
            )
        except WireError:
            return None
        if reply_to is None or owner is None:
            return None
        body = submit.body if isinstance(submit, SubmitEnvelope) else incoming.body
        return ForwardedSubmission(owner, reply_to, submit.stream, client_id, client_request_id, body)

    def _batches(self, reply_to: str, owner: str) -> bool:
        """Whether replies to ``reply_to`` may go in reply batches: its batch subject is one replies
        may go to, under the same owner (else they go alone, as for a client that reads no batches)."""
        subject = batch_subject(reply_to)
        return subject is not None and self._replies.check(subject) == (owner, None)

    def _reply_subject(self, incoming: Incoming, reply_to: str) -> tuple[str, str]:
        """Where replies go and who owns them: ``reply_to`` under an inbox prefix, the sender's own
        (its NATS reply subject's, which the coordinator checked on arrival) when it gave one."""
        owner, problem = self._replies.check(reply_to)
        if owner is None or problem is not None:
            raise WireError(ErrorCode.MALFORMED, f"reply_to {reply_to[:256]!r} {problem}")
        if incoming.owner is None and owner != self._shared_inbox:
            # A plain publish names no sender, so it may not reply into a per-user inbox.
            raise WireError(
                ErrorCode.MALFORMED,
                f"reply_to {reply_to[:256]!r}: a submission without a NATS reply subject may reply only under "
                f"the shared inbox prefix {self._shared_inbox!r} (give a reply subject, as `nats request` does)",
            )
        if incoming.owner is not None and owner != incoming.owner:
            raise WireError(
                ErrorCode.MALFORMED,
                f"reply_to {reply_to!r} is not under the sender's own inbox prefix {incoming.owner!r}",
            )
        return reply_to, owner

    def _check_ids(self, client_request_id: ClientRequestId | None, client_id: str | None) -> None:
        limit = self._max_id
        for name, value in (("client_request_id", client_request_id), ("client_id", client_id)):
            if isinstance(value, str) and (len(value) > limit or utf8_length(value) > limit):
                raise WireError(ErrorCode.MALFORMED, f"{name} is longer than max_id_bytes ({limit})")

    def _engines_serving(self, model: str) -> EngineGroup | None:
        """404 for a model no engine serves, unless this replica is still learning the fleet
        (then None: the request waits for heartbeats to introduce the fleet)."""
        group = self._pool.group(model)
        if group is not None or not self._peers.warmed_up:
            return group
        raise unknown_model(self._pool, model)

    async def resubmitted(self, client_key: ClientKey, reply_to: str, stream: bool, owner: str, body: bytes) -> bool:
        """Answer a repeated ``(client_id, client_request_id)``; False when it is new.

        Anonymous clients share one namespace, so for them a repeat in flight is refused."""
        existing = self._ledger.find_client(client_key)
        if client_key[0] is None:
            if existing is not None:
                raise WireError(ErrorCode.CONFLICT, f"client_request_id {client_key[1]!r} is already in flight")
            return False
        if existing is not None:
            _same_submission(client_key, existing.owner, owner, existing.body == body)
            if reply_to != existing.return_path.reply_to:
                # Another inbox would leave the first one silent: the copy is told, and its
                # result is there for it once the request ends (a resubmission then replays it).
                raise WireError(
                    ErrorCode.CONFLICT,
                    f"client_request_id {client_key[1]!r} of client_id {client_key[0]!r} is in progress for another "
                    "reply subject; submit it again once it ends to get its result",
                )
            self._ledger.repoint(existing, reply_to, stream)
            self._counters["resubmitted"] += 1
            return True
        cached = self._answers.cached(client_key)
        if cached is None:
            return False
        _same_submission(client_key, cached.owner, owner, cached.request_digest in (None, body_digest(body)))
        if self._answers.repoint(client_key, reply_to):
            self._counters["resubmitted"] += 1
            return True
        await self._answers.replay(client_key, cached, reply_to, stream)
        return True


def _same_submission(client_key: ClientKey, owner: str, new_owner: str, same_body: bool) -> None:
    """A resubmission must come from the original's owner (403) with the original's body (409)."""
    client_id, client_request_id = client_key
    if new_owner != owner:
        raise WireError(
            ErrorCode.FORBIDDEN,
            f"client_request_id {client_request_id!r} of client_id {client_id!r} belongs to another owner",
        )
    if not same_body:
        raise WireError(
            ErrorCode.CONFLICT,
            f"client_request_id {client_request_id!r} of client_id {client_id!r} was submitted with another body",
        )
