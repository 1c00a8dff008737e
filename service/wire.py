"""Typed wire messages and their two encodings.

A payload is a JSON object or a msgpack map, detected per message: a body whose first
non-blank byte is ``{`` is JSON (a msgpack map never starts with it), an empty body is
``{}`` in JSON, anything else is msgpack. A reply uses the encoding of what it answers.

Unknown keys are ignored (forward compatibility); wrong types and missing required
fields raise :class:`~service.errors.WireError` with code 400.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from service.errors import ErrorCode, WireError

ClientRequestId = str | int
FinishReason = Literal["length", "stop", "abort"]


class Encoding(enum.Enum):
    JSON = "json"
    MSGPACK = "msgpack"


_JSON_BLANKS = b" \t\r\n"


def detect_encoding(body: bytes) -> Encoding:
    if not body or body[0] == 0x7B:
        return Encoding.JSON
    if body[0] in _JSON_BLANKS:
        stripped = body.lstrip(_JSON_BLANKS)
        if not stripped or stripped[0] == 0x7B:
            return Encoding.JSON
    return Encoding.MSGPACK


# ---------------------------------------------------------------- from clients


class SamplingParams(Struct, omit_defaults=True):
    """Engines apply their own defaults to fields left out (see engines/backend.py)."""

    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: list[str] | None = None
    timeout_s: Annotated[float, Meta(gt=0.0)] | None = None


class SubmitRequest(Struct):
    prompt: str | list[Annotated[int, Meta(ge=0)]]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    client_request_id: ClientRequestId | None = None
    client_id: str | None = None
    reply_to: Annotated[str, Meta(pattern=r"^[^\s*>]+$")] | None = None  # a subject one can publish to


class ConnectRequest(Struct):
    client_id: str | None = None


class AbortRequest(Struct):
    client_request_id: ClientRequestId | None = None
    client_id: str | None = None
    request_id: str | None = None


class ControlSignal(Struct):
    """Control and profiler signals need no fields; ``set_generation_epoch`` needs ``epoch``."""

    epoch: int | None = None


class Empty(Struct):
    pass


class ReturnHints(Struct):
    """Where to send an error for a message that failed validation: read leniently."""

    reply_to: Any = None
    stream: Any = None
    client_request_id: Any = None


# ---------------------------------------------------------------- to clients


class ErrorBody(Struct):
    code: int
    message: str


class Partial(Struct, tag="partial", tag_field="type"):
    request_id: str
    client_request_id: ClientRequestId | None
    new_tokens: list[int]
    text: str


class EpochSpan(Struct):
    """Tokens ``[start, end)`` of a reply were generated under ``epoch``."""

    epoch: int | None
    start: int
    end: int


class Final(Struct, tag="final", tag_field="type", omit_defaults=True):
    request_id: str
    client_request_id: ClientRequestId | None
    engine_id: str | None
    generated_tokens: list[int]
    generated_text: str
    finish_reason: FinishReason
    epochs: list[EpochSpan] | None = None


class ErrorReply(Struct, tag="error", tag_field="type", omit_defaults=True):
    error: ErrorBody
    client_request_id: ClientRequestId | None = None
    request_id: str | None = None


class Ack(Struct, tag="ack", tag_field="type", omit_defaults=True):
    signal: str
    state: str | None = None
    request_id: str | None = None
    epoch: int | None = None
    engines: dict[str, str] | None = None


class ConnectAck(Struct, tag="connect_ack", tag_field="type"):
    client_id: str
    coordinator_id: str
    protocol_version: int


Reply = Partial | Final | ErrorReply | Ack | ConnectAck


def error_reply(err: WireError, client_request_id: ClientRequestId | None = None, request_id: str | None = None) -> ErrorReply:
    return ErrorReply(error=ErrorBody(err.code, err.message), client_request_id=client_request_id, request_id=request_id)


# ---------------------------------------------------------------- engines <-> coordinator (msgpack only)


class EngineRegister(Struct):
    engine_id: str
    capacity: Annotated[int, Meta(ge=1)] = 256
    backend: str = "unknown"
    paused: bool = False


class RegisterAck(Struct):
    coordinator_id: str
    state: str
    epoch: int | None


class Heartbeat(Struct):
    """``active`` lists the requests the engine holds, so the coordinator can notice one that
    a lost message left unanswered."""

    engine_id: str
    load: Annotated[int, Meta(ge=0)] = 0
    capacity: Annotated[int, Meta(ge=1)] = 256
    active: list[str] = msgspec.field(default_factory=list)


class ResendReplies(Struct):
    request_ids: list[str]


class ResendAnswer(Struct):
    """Ids the engine neither holds nor recently answered: it never received them."""

    unknown: list[str]


class CoordinatorHeartbeat(Struct):
    coordinator_id: str


class EngineDisconnect(Struct):
    engine_id: str
    reason: str = ""


class ReturnPath(Struct, array_like=True):
    """Everything needed to answer a client, carried with the request (principle 4)."""

    request_id: str
    coordinator_id: str
    reply_to: str
    encoding: str
    stream: bool
    client_request_id: ClientRequestId | None
    client_id: str | None = None


class RoutedRequest(Struct, array_like=True):
    """A client's submission as routed to one engine: its return path plus the untouched body."""

    route: ReturnPath
    body: bytes


class RoutedAbort(Struct):
    request_id: str


class RoutedReply(Struct, array_like=True):
    """One reply, already encoded for its client, with the route to deliver it.

    ``seq`` orders a stream across the two engine subjects: a partial's index, or for a final
    the number of partials sent before it, so the coordinator never delivers a final ahead of
    a partial still in flight on the other subject.
    """

    route: ReturnPath
    body: bytes
    seq: int = 0


class EngineReplyBatch(Struct):
    engine_id: str
    replies: list[RoutedReply]


class EngineAck(Struct):
    """An engine's confirmation of a broadcast control or profiler signal."""

    engine_id: str
    signal: str
    ok: bool = True
    detail: str = ""


# ---------------------------------------------------------------- codecs

T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()
_lenient_json = msgspec.json.Decoder(ReturnHints)
_lenient_msgpack = msgspec.msgpack.Decoder(ReturnHints)


class PayloadDecoder:
    """Decodes one payload type from either encoding, raising WireError(400) on bad input."""

    __slots__ = ("_json", "_msgpack", "type")

    def __init__(self, payload_type: type[T]) -> None:
        self.type = payload_type
        self._json = msgspec.json.Decoder(payload_type)
        self._msgpack = msgspec.msgpack.Decoder(payload_type)

    def decode(self, body: bytes, encoding: Encoding) -> Any:
        try:
            if encoding is Encoding.JSON:
                return self._json.decode(body or b"{}")
            return self._msgpack.decode(body)
        except msgspec.ValidationError as exc:
            raise WireError(ErrorCode.MALFORMED, f"invalid {self.type.__name__}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise WireError(ErrorCode.MALFORMED, f"undecodable {encoding.value} body: {exc}") from None


def encode(message: Struct, encoding: Encoding) -> bytes:
    if encoding is Encoding.JSON:
        return _json_encoder.encode(message)
    return _msgpack_encoder.encode(message)


def encode_msgpack(message: Struct) -> bytes:
    return _msgpack_encoder.encode(message)


def return_hints(body: bytes, encoding: Encoding) -> ReturnHints:
    """Best-effort read of reply_to, stream and client_request_id from a rejected body."""
    try:
        if encoding is Encoding.JSON:
            return _lenient_json.decode(body or b"{}")
        return _lenient_msgpack.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return ReturnHints()


def msgpack_decoder(payload_type: type[T]) -> msgspec.msgpack.Decoder[T]:
    return msgspec.msgpack.Decoder(payload_type)
