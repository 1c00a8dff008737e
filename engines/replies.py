"""Replies on their way from an engine to the coordinator.

:class:`ActiveRequest` accumulates one request's tokens and builds its replies, already encoded
for its client from the return path it carries, so the coordinator only forwards bytes. It is
the request table's record (:mod:`engines.requests`): only the table creates one and calls the
methods that change it (an import-linter contract keeps the runtime's jobs from importing this
module).
:class:`ReplyPublisher` sends them, on ``<prefix>.<header>.<engine_id>``, in as few messages as
the server's ``max_payload`` allows, counting every byte of each reply (its body and its whole
return path, in UTF-8), so one oversized reply never takes its batch neighbours with it. A
reply too large for any message is replaced with a 413 error, or dropped and counted when even
that does not fit (a return path no coordinator would route). Recent terminal replies are
remembered, bounded by count and bytes, so that one lost on the way (a NATS restart, say) can
be sent again.

Every reply carries the run (``attempt``) of the routed request it answers; a partial also
carries its ``offset`` (the index of its first token among the generated ones) and, beside the
client's body, its token ids, so the coordinator keeps what was streamed for a migration. A
resumed request (:meth:`ActiveRequest.resume`) starts with the tokens and text an earlier run
streamed: its partials continue at their offset and its final holds every token.

Every final of a request the engine held carries its ``timings`` (docs/protocol.md, *Timings*),
from monotonic readings the request table stamps: its arrival (made with the record), the start
and end of the step that produced its first token of this run, and the end of its last step.
A traced request (:mod:`service.ops.tracing`) has its spans made from the same readings when it
leaves (:meth:`ActiveRequest.trace_left`).

A request that asked for log-probabilities has a :class:`~engines.logprob_record.LogprobRecord`
beside its tokens, whose values its replies carry; the others' partials are encoded without
those fields (:class:`~service.protocol.messages.PartialWithoutLogprobs`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING

import msgspec
from nats.errors import Error as NatsError

from engines.backend import TokenOutput
from engines.logprob_record import LogprobRecord
from service.bus.batches import fits_alone, item_size, split_batches
from service.bus.direct import DirectClient
from service.protocol.codec import Encoding, encode, encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.logprobs import StreamedLogprobs
from service.protocol.messages import (
    EpochSpan,
    Final,
    FinishReason,
    Partial,
    PartialWithoutLogprobs,
    Timings,
    WeightVersion,
    WeightVersionSpan,
    error_reply,
)
from service.protocol.routed import AdoptedRequest, EngineReplyBatch, ReturnPath, RoutedReply
from service.protocol.subjects import Header, Subjects

if TYPE_CHECKING:
    from service.ops.tracing.otel import EngineTrace

log = logging.getLogger(__name__)

# Terminal replies kept so one lost on the way can be sent again.
RECENT_REPLIES_KEPT = 10_000


@dataclass(slots=True, eq=False)
class ActiveRequest:
    return_path: ReturnPath
    encoding: Encoding
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    unsent_tokens: list[int] = field(default_factory=list)
    unsent_text: list[str] = field(default_factory=list)
    partials_sent: int = 0
    epochs: list[EpochSpan] = field(default_factory=list)
    prompt_tokens: int | None = None
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    body: bytes = b""  # the client's, handed to the adopter of a dead coordinator with the request
    attempt: int = 0
    logprobs: LogprobRecord | None = None  # a request that asked for log-probabilities
    trace: EngineTrace | None = None  # its spans' context, when it is traced
    # Monotonic readings for its timings: arrival here; the start and end of the step that made
    # its first token of this run (0.0 until then); cached prompt tokens, from that first output.
    arrived: float = field(default_factory=time.monotonic)
    first_step: float = 0.0
    first_token: float = 0.0
    cached_prompt_tokens: int = 0

    def first_output(self, started: float, ended: float, cached_tokens: int) -> None:
        """Its first token of this run came from the step over ``[started, ended]``."""
        self.first_step, self.first_token, self.cached_prompt_tokens = started, ended, cached_tokens

    def timings(self, ended: float) -> Timings:
        """Its timings, the last token (or the end) at ``ended``."""
        first_step, first_token = self.first_step, self.first_token
        if not first_token:  # no token of this run: it waited all along
            return Timings(ended - self.arrived)
        return Timings(
            first_step - self.arrived, first_token - self.arrived, ended - first_token, self.cached_prompt_tokens
        )

    def trace_left(self, ended: float, finish_reason: FinishReason | None, error: WireError | None = None) -> None:
        """A traced request's spans, as it leaves at ``ended`` (nothing when it is not traced)."""
        if self.trace is None:
            return
        attributes: dict[str, str | int | list[str]] = {
            "dpcoord.request_id": self.return_path.request_id,
            "dpcoord.attempt": self.attempt,
            "dpcoord.cached_prompt_tokens": self.cached_prompt_tokens,
            "gen_ai.usage.output_tokens": len(self.tokens),
        }
        if self.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = self.prompt_tokens
        if finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = [finish_reason]
        failure = None if error is None else (error.code, error.message)
        self.trace.left(attributes, self.arrived, self.first_step, self.first_token, ended, failure)

    def resume(self, tokens: list[int], text: str, epoch: int | None) -> None:
        """Start after ``tokens`` (and their ``text``) that an earlier run streamed; their span
        is attributed to ``epoch``, the one in force as this run starts."""
        self.tokens.extend(tokens)
        self.text.append(text)
        if tokens:
            self.epochs.append(EpochSpan(epoch, 0, len(tokens)))

    def hand_over(self, adopter: str) -> AdoptedRequest:
        """Name ``adopter`` in this request's replies from now on, and describe it for it."""
        self.return_path = msgspec.structs.replace(self.return_path, coordinator_id=adopter)
        logprobs = None if self.logprobs is None else self.logprobs.streamed()
        return AdoptedRequest(
            self.return_path, self.body, self.partials_sent, list(self.tokens), self.attempt, logprobs
        )

    def record(self, output: TokenOutput, epoch: int | None, weight_version: WeightVersion | None = None) -> None:
        if output.new_tokens:
            start = len(self.tokens)
            end = start + len(output.new_tokens)
            if self.epochs and self.epochs[-1].epoch == epoch:
                self.epochs[-1].end = end
            else:
                self.epochs.append(EpochSpan(epoch, start, end))
            versions = self.weight_versions
            if versions and versions[-1].version == weight_version:
                versions[-1].end = end
            else:
                versions.append(WeightVersionSpan(weight_version, start, end))
        if self.logprobs is not None:
            self.logprobs.record(output)
        self.tokens.extend(output.new_tokens)
        self.text.append(output.text)
        self.unsent_tokens.extend(output.new_tokens)
        self.unsent_text.append(output.text)

    def partial(self) -> RoutedReply:
        return_path = self.return_path
        tokens = self.unsent_tokens
        text = "".join(self.unsent_text)
        offset = len(self.tokens) - len(tokens)
        logprobs = self.logprobs
        message: Partial | PartialWithoutLogprobs
        streamed = None
        if logprobs is None or not logprobs.generated:
            message = PartialWithoutLogprobs(
                return_path.request_id, return_path.client_request_id, tokens, text, offset, self.attempt
            )
        else:
            fields = logprobs.partial(tokens)
            assert fields.token_logprobs is not None, "a request that asked has its tokens' logprobs"
            message = Partial(
                return_path.request_id,
                return_path.client_request_id,
                tokens,
                text,
                offset,
                self.attempt,
                fields.token_logprobs,
                fields.top_logprobs,
                fields.token_bytes,
            )
            streamed = StreamedLogprobs(fields.token_logprobs, fields.top_logprobs)
        self.unsent_tokens, self.unsent_text = [], []
        reply = RoutedReply(
            return_path, encode(message, self.encoding), self.partials_sent, tokens, self.attempt, streamed
        )
        self.partials_sent += 1
        return reply

    def final(self, engine_id: str, finish_reason: FinishReason, ended: float | None = None) -> RoutedReply:
        """The final, its last token (or the end) at ``ended`` (now when None)."""
        return_path = self.return_path
        message = Final(
            return_path.request_id,
            return_path.client_request_id,
            engine_id,
            self.tokens,
            "".join(self.text),
            finish_reason,
            epochs=self.epochs or None,
            prompt_tokens=self.prompt_tokens,
            weight_versions=self.weight_versions or None,
            timings=self.timings(time.monotonic() if ended is None else ended),
        )
        if self.logprobs is not None:
            fields = self.logprobs.final(self.tokens)
            message.token_logprobs, message.top_logprobs = fields.token_logprobs, fields.top_logprobs
            message.token_bytes = fields.token_bytes
            prompt = fields.prompt
            if prompt is not None:
                message.prompt_token_ids, message.prompt_logprobs = prompt.token_ids, prompt.logprobs
                message.prompt_top_logprobs = prompt.top_logprobs
        return RoutedReply(return_path, encode(message, self.encoding), self.partials_sent, attempt=self.attempt)

    def error(self, err: WireError) -> RoutedReply:
        return_path = self.return_path
        reply = error_reply(err, return_path.client_request_id, return_path.request_id)
        return RoutedReply(return_path, encode(reply, self.encoding), self.partials_sent, attempt=self.attempt)


def reply_size(reply: RoutedReply) -> int:
    """Bytes a reply takes in a batch."""
    return item_size(reply.body, reply.return_path, reply.tokens, reply.logprobs)


class ReplyPublisher:
    def __init__(
        self,
        engine_id: str,
        nc: DirectClient,
        subjects: Subjects,
        counters: Counter[str],
        recent_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self._engine_id = engine_id
        self._nc = nc
        self._subjects = subjects
        self._counters = counters
        self._recent: OrderedDict[str, tuple[RoutedReply, int]] = OrderedDict()  # with its size
        self._recent_bytes = 0
        self._max_recent_bytes = recent_bytes

    def recent(self, request_id: str) -> RoutedReply | None:
        kept = self._recent.get(request_id)
        return None if kept is None else kept[0]

    async def publish(self, header: Header, replies: list[RoutedReply], remember: bool = True) -> None:
        """Send ``replies`` on ``header``'s subject; terminal ones are remembered when ``remember``."""
        if not replies:
            return
        max_payload = self._nc.max_payload
        sized = [(reply, reply_size(reply)) for reply in replies]  # each reply's size, counted once
        if not all(fits_alone(size, max_payload) for _, size in sized):
            fitted = (self._fitted(reply, max_payload) for reply, _ in sized)
            sized = [(reply, reply_size(reply)) for reply in fitted if reply is not None]
        if remember and header == Header.ENGINE_REPLY:
            self._remember(sized)
        subject = self._subjects.sent_by(header, self._engine_id)
        for batch in split_batches(sized, itemgetter(1), max_payload):
            await self._send(subject, [reply for reply, _ in batch])

    async def _send(self, subject: str, batch: list[RoutedReply]) -> None:
        """A batch NATS cannot take now is lost, not fatal: the coordinator's deadline answers it."""
        try:
            await self._nc.publish(subject, encode_msgpack(EngineReplyBatch(self._engine_id, batch)))
        except NatsError as exc:
            self._counters["replies_lost"] += len(batch)
            log.warning("engine_id=%s: %d replies lost: %s", self._engine_id, len(batch), exc)

    def _remember(self, sized: list[tuple[RoutedReply, int]]) -> None:
        recent = self._recent
        for reply, size in sized:
            previous = recent.pop(reply.return_path.request_id, None)
            if previous is not None:
                self._recent_bytes -= previous[1]
            recent[reply.return_path.request_id] = (reply, size)
            self._recent_bytes += size
        while recent and (len(recent) > RECENT_REPLIES_KEPT or self._recent_bytes > self._max_recent_bytes):
            self._recent_bytes -= recent.popitem(last=False)[1][1]

    def _fitted(self, reply: RoutedReply, max_payload: int) -> RoutedReply | None:
        """``reply`` if it fits one message, else a 413 error for its request if that fits, else None."""
        if fits_alone(reply_size(reply), max_payload):
            return reply
        return_path = reply.return_path
        err = WireError(ErrorCode.TOO_LARGE, f"reply of {len(reply.body)} bytes exceeds NATS max_payload {max_payload}")
        body = encode(
            error_reply(err, return_path.client_request_id, return_path.request_id), Encoding(return_path.encoding)
        )
        error = RoutedReply(return_path, body, reply.seq, attempt=reply.attempt)
        if fits_alone(reply_size(error), max_payload):
            return error
        self._counters["replies_undeliverable"] += 1
        log.warning(
            "engine_id=%s request_id=%s: reply dropped, its return path alone exceeds NATS max_payload %d",
            self._engine_id,
            return_path.request_id[:64],
            max_payload,
        )
        return None
