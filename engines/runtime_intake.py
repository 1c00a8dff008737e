"""Request intake: the messages a coordinator routes to this engine alone, on
``<prefix>.engine.<engine_id>.<header>``. Routed requests start on the backend (or are refused
with their own error reply), aborts end them, holds hold them back from the steps until
released, and terminal replies are sent again on request.

Contract: a routed request this engine cannot serve (an unknown encoding, an undecodable body,
over the limits on stop strings or ``max_tokens``, asking for log-probabilities of a backend
that computes none, refused by the backend, or failing in any
other way) gets its own error reply where its encoding is known, and is counted and logged
otherwise; the requests routed with it in the same message are not affected. Every change to
the requests held goes through the request table (:mod:`engines.requests`). These methods run
on nats-py's reading task (:mod:`service.bus.direct`): they publish and never wait for
another message.

With tracing on, a routed message whose NATS headers carry a ``traceparent`` holds one traced
request (the coordinator sends each alone), which continues that trace (:mod:`service.ops.tracing`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engines.backend import GenerationRequest, PromptPrefix
from engines.control_state import ControlState
from engines.limits import check_limits, check_resume
from engines.requests import RequestTable
from engines.runtime_core import EngineCore
from service.bus.registry import Incoming
from service.ops.log_limit import RateLimitedLog
from service.ops.tracing import traceparent_in
from service.protocol.codec import Encoding, PayloadDecoder
from service.protocol.errors import ErrorCode, WireError
from service.protocol.membership import ResendAnswer, ResendReplies
from service.protocol.messages import SubmitRequest
from service.protocol.prefix import TOKENS_PER_BLOCK, prompt_prefixes
from service.protocol.routed import RoutedAbort, RoutedHold, RoutedRequest, RoutedRequestBatch

if TYPE_CHECKING:
    from service.ops.tracing.otel import EngineTrace

log = logging.getLogger(__name__)

_submit_decoder = PayloadDecoder(SubmitRequest)


class RequestIntake:
    def __init__(self, core: EngineCore, requests: RequestTable, control: ControlState) -> None:
        self._core = core
        self._engine_id = core.engine_id
        self._settings = core.settings
        self._backend = core.backend
        self._counters = core.counters
        self._requests = requests
        self._control = control
        self._refusal_log = RateLimitedLog(log)
        self._tracer = core.tracer
        self._trace_attributes = {
            "dpcoord.engine_id": core.engine_id,
            "gen_ai.request.model": core.settings.served_model_name or core.backend.default_model_name,
        }

    async def start_batch(self, incoming: Incoming, batch: RoutedRequestBatch) -> None:
        """Sent by a coordinator (``submit_request``): every request it routed here in one loop
        turn, each a return path and the client's body. Each starts generating; no answer (the
        replies follow, or a request's own error reply). A message with a ``traceparent`` header
        holds one traced request."""
        trace = None
        if self._tracer is not None and len(batch.requests) == 1:
            traceparent = traceparent_in(incoming.headers)
            if traceparent is not None:
                trace = self._tracer.engine_request(traceparent, self._trace_attributes)
        for routed in batch.requests:
            await self.start(routed, trace)

    async def start(self, routed: RoutedRequest, trace: EngineTrace | None = None) -> None:
        return_path = routed.return_path
        try:
            encoding = Encoding(return_path.encoding)
        except ValueError:
            self._counters["malformed"] += 1
            self._refusal_log.warning(
                "engine_id=%s request_id=%s: unknown encoding %r; dropped",
                self._engine_id,
                return_path.request_id,
                return_path.encoding,
            )
            return
        if not self._requests.supersede(routed):
            return
        try:
            self._requests.start(routed, encoding, self._generation(routed, encoding), self._control.epoch, trace)
        except Exception as exc:
            if isinstance(exc, WireError):
                err = exc
                self._refusal_log.warning(
                    "engine_id=%s request_id=%s refused: %s", self._engine_id, return_path.request_id, err
                )
            else:
                err = WireError(ErrorCode.INTERNAL, f"engine {self._engine_id} could not start the request")
                self._refusal_log.exception(
                    "engine_id=%s request_id=%s: starting it failed", self._engine_id, return_path.request_id
                )
            await self._requests.refuse(routed, encoding, err)
            return
        self._core.wake.set()

    def _generation(self, routed: RoutedRequest, encoding: Encoding) -> GenerationRequest:
        """What the backend generates for ``routed``; raises WireError for a body it must refuse."""
        submit = _submit_decoder.decode(routed.body, encoding)
        backend = self._backend
        check_limits(submit, self._settings, backend.max_context)
        if submit.sampling_params.asks_logprobs and not backend.computes_logprobs:
            raise WireError(
                ErrorCode.MALFORMED,
                f"engine {self._engine_id} ({backend.name} backend) computes no log-probabilities "
                "(sampling_params.logprobs, prompt_logprobs)",
            )
        prompt = submit.prompt if submit.prompt is not None else backend.render_chat(submit.messages or ())
        request = GenerationRequest.from_submit(routed.return_path.request_id, submit, prompt)
        if backend.publishes_kv_events:
            request.prefixes = _prefixes(submit)
        resume = routed.resume_tokens
        if resume:
            check_resume(resume, request.max_tokens)
            request.resume_tokens = tuple(resume)
        return request

    async def abort(self, incoming: Incoming, abort: RoutedAbort) -> None:
        """Sent by a coordinator (``abort_request``) when a client aborts or the request failed
        elsewhere: its request id. Generation stops and the final says ``abort``; no answer
        (nothing happens for a request this engine does not hold)."""
        await self._requests.abort(abort.request_id)

    async def hold(self, incoming: Incoming, hold: RoutedHold) -> None:
        """Sent by the request's coordinator (``hold_request``) when its client's reader fell
        behind (``held``) or caught up: the request is held back from the steps or released,
        the newer ``seq`` winning; no answer (nothing happens for a request not held here)."""
        if self._requests.hold(hold.request_id, hold.held, hold.seq) and not hold.held:
            self._core.wake.set()

    async def resend(self, incoming: Incoming, resend: ResendReplies) -> None:
        """Sent by a coordinator reconciling after lost messages (``resend_replies``, a request):
        request ids this engine no longer holds. The terminal replies it remembers are sent
        again; the answer (``ResendAnswer``) lists the ids it never received."""
        unknown = await self._requests.resend(resend.request_ids)
        await self._core.answer(incoming.reply, ResendAnswer(unknown))


def _prefixes(submit: SubmitRequest) -> tuple[PromptPrefix, ...]:
    """The prompt's prefixes as submitted, hashed as the client and the coordinator hash them
    (docs/protocol.md, *KV events*): a token prompt's cover ``16 * blocks`` of its tokens; a text
    or chat prompt's, whose blocks are bytes, its whole length."""
    tokens = isinstance(submit.prompt, list)
    return tuple(
        PromptPrefix(prefix_hash, blocks, blocks * TOKENS_PER_BLOCK if tokens else None)
        for prefix_hash, blocks in prompt_prefixes(submit.prompt, submit.messages)
    )
