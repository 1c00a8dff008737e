"""Replies on their way from an engine to the coordinator.

:class:`ActiveRequest` accumulates one request's tokens and builds its replies, already encoded
for its client from the return path it carries, so the coordinator only forwards bytes.
:class:`ReplyPublisher` sends them in as few messages as the server's ``max_payload`` allows,
replaces a reply too large for any message with a 413 error, and remembers recent terminal
replies so that one lost on the way (a NATS restart, say) can be sent again.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from nats.errors import Error as NatsError

from engines.backend import TokenOutput
from service.bus.batches import ITEM_OVERHEAD, fits_alone, split_batches
from service.bus.direct import DirectClient
from service.protocol.codec import Encoding, encode, encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import (
    EngineReplyBatch,
    EpochSpan,
    Final,
    FinishReason,
    Partial,
    ReturnPath,
    RoutedReply,
    error_reply,
)
from service.protocol.subjects import Header, Subjects

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

    def record(self, output: TokenOutput, epoch: int | None) -> None:
        if output.new_tokens:
            start = len(self.tokens)
            end = start + len(output.new_tokens)
            if self.epochs and self.epochs[-1].epoch == epoch:
                self.epochs[-1].end = end
            else:
                self.epochs.append(EpochSpan(epoch, start, end))
        self.tokens.extend(output.new_tokens)
        self.text.append(output.text)
        self.unsent_tokens.extend(output.new_tokens)
        self.unsent_text.append(output.text)

    def partial(self) -> RoutedReply:
        return_path = self.return_path
        message = Partial(
            return_path.request_id, return_path.client_request_id, self.unsent_tokens, "".join(self.unsent_text)
        )
        self.unsent_tokens, self.unsent_text = [], []
        reply = RoutedReply(return_path, encode(message, self.encoding), seq=self.partials_sent)
        self.partials_sent += 1
        return reply

    def final(self, engine_id: str, finish_reason: FinishReason) -> RoutedReply:
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
        )
        return RoutedReply(return_path, encode(message, self.encoding), seq=self.partials_sent)

    def error(self, err: WireError) -> RoutedReply:
        return_path = self.return_path
        reply = error_reply(err, return_path.client_request_id, return_path.request_id)
        return RoutedReply(return_path, encode(reply, self.encoding), seq=self.partials_sent)


def reply_size(reply: RoutedReply) -> int:
    """Bytes a reply takes in a batch: its body and the strings of its return path."""
    return_path = reply.return_path
    return (
        len(reply.body)
        + len(return_path.reply_to)
        + len(return_path.request_id)
        + len(return_path.coordinator_id)
        + len(str(return_path.client_request_id))
        + len(return_path.client_id or "")
        + ITEM_OVERHEAD
    )


class ReplyPublisher:
    def __init__(self, engine_id: str, nc: DirectClient, subjects: Subjects, counters: Counter[str]) -> None:
        self._engine_id = engine_id
        self._nc = nc
        self._subjects = subjects
        self._counters = counters
        self._recent: OrderedDict[str, RoutedReply] = OrderedDict()

    def recent(self, request_id: str) -> RoutedReply | None:
        return self._recent.get(request_id)

    async def publish(self, header: Header, replies: list[RoutedReply], remember: bool = True) -> None:
        """Send ``replies`` on ``header``'s subject; terminal ones are remembered when ``remember``."""
        if not replies:
            return
        max_payload = self._nc.max_payload
        replies = [reply if fits_alone(reply_size(reply), max_payload) else self._too_large(reply) for reply in replies]
        if remember and header == Header.ENGINE_REPLY:
            recent = self._recent
            for reply in replies:
                recent[reply.return_path.request_id] = reply
            while len(recent) > RECENT_REPLIES_KEPT:
                recent.popitem(last=False)
        subject = self._subjects.coordinator(header)
        for batch in split_batches(replies, reply_size, max_payload):
            await self._send(subject, batch)

    async def _send(self, subject: str, batch: list[RoutedReply]) -> None:
        """A batch NATS cannot take now is lost, not fatal: the coordinator's deadline answers it."""
        try:
            await self._nc.publish(subject, encode_msgpack(EngineReplyBatch(self._engine_id, batch)))
        except NatsError as exc:
            self._counters["replies_lost"] += len(batch)
            log.warning("engine_id=%s: %d replies lost: %s", self._engine_id, len(batch), exc)

    def _too_large(self, reply: RoutedReply) -> RoutedReply:
        return_path = reply.return_path
        err = WireError(
            ErrorCode.TOO_LARGE, f"reply of {len(reply.body)} bytes exceeds NATS max_payload {self._nc.max_payload}"
        )
        body = encode(
            error_reply(err, return_path.client_request_id, return_path.request_id), Encoding(return_path.encoding)
        )
        return RoutedReply(return_path, body, reply.seq)
