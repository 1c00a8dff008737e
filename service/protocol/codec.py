"""The two encodings of wire messages, detected per message.

A payload is a JSON object or a msgpack map, detected per message: a body whose first
non-blank byte is ``{`` is JSON (a msgpack map never starts with it), an empty body is
``{}`` in JSON, anything else is msgpack. A reply uses the encoding of what it answers.

Unknown keys are ignored (forward compatibility); wrong types, missing required fields and
bodies nested too deeply to decode raise :class:`~service.protocol.errors.WireError` with code
400.
"""

from __future__ import annotations

import enum
import types
from typing import Any, TypeVar, get_args

import msgspec
from msgspec import Struct

from service.protocol.errors import ErrorCode, WireError


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


class ReturnHints(Struct):
    """Where to send an error for a message that failed validation: read leniently."""

    reply_to: Any = None
    stream: Any = None
    client_request_id: Any = None


class EnvelopeHints(Struct, array_like=True):
    """:class:`ReturnHints` of a :class:`SubmitEnvelope`, read as leniently."""

    version: Any = None
    body: Any = None
    stream: Any = None
    client_request_id: Any = None
    client_id: Any = None
    reply_to: Any = None


# ---------------------------------------------------------------- codecs

T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()
_lenient_json = msgspec.json.Decoder(ReturnHints)
_lenient_msgpack = msgspec.msgpack.Decoder(ReturnHints)
_lenient_envelope = msgspec.msgpack.Decoder(EnvelopeHints)


_MSGPACK_ARRAY_FIRST_BYTES = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


def is_msgpack_array(body: bytes) -> bool:
    return bool(body) and body[0] in _MSGPACK_ARRAY_FIRST_BYTES


def _is_array_like(member: Any) -> bool:
    config = getattr(member, "__struct_config__", None)
    return bool(config and config.array_like)


class PayloadDecoder:
    """Decodes one payload type from either encoding, raising WireError(400) on bad input.

    The type may be a union of one map-shaped Struct and one ``array_like`` Struct (msgspec
    would need tags to tell untagged Structs apart); a msgpack array body decodes as the
    array-shaped member, anything else as the map-shaped one. A lone ``array_like`` Struct
    (the messages between dpcoord processes) decodes from a msgpack or JSON array."""

    __slots__ = ("_array", "_json", "_msgpack", "type")

    def __init__(self, payload_type: Any) -> None:
        self.type = payload_type
        members = get_args(payload_type) if isinstance(payload_type, types.UnionType) else (payload_type,)
        arrays = [member for member in members if _is_array_like(member)]
        maps = [member for member in members if not _is_array_like(member)]
        if len(arrays) > 1 or len(maps) > 1 or not members:
            raise TypeError(
                f"payload type {payload_type!r}: need one map-shaped type and at most one array_like Struct"
            )
        main = maps[0] if maps else arrays[0]
        self._json = msgspec.json.Decoder(main)
        self._msgpack = msgspec.msgpack.Decoder(main)
        self._array = msgspec.msgpack.Decoder(arrays[0]) if arrays and maps else None

    def decode(self, body: bytes, encoding: Encoding) -> Any:
        try:
            if encoding is Encoding.JSON:
                return self._json.decode(body or b"{}")
            if self._array is not None and body[0] in _MSGPACK_ARRAY_FIRST_BYTES:  # is_msgpack_array, inlined: hot
                return self._array.decode(body)
            return self._msgpack.decode(body)
        except msgspec.ValidationError as exc:
            raise WireError(ErrorCode.MALFORMED, f"invalid {_type_name(self.type)}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise WireError(ErrorCode.MALFORMED, f"undecodable {encoding.value} body: {exc}") from None
        except RecursionError:
            raise WireError(ErrorCode.MALFORMED, f"undecodable {encoding.value} body: nested too deeply") from None


def _type_name(payload_type: Any) -> str:
    return getattr(payload_type, "__name__", None) or " | ".join(member.__name__ for member in get_args(payload_type))


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
        if is_msgpack_array(body):
            envelope = _lenient_envelope.decode(body)
            return ReturnHints(envelope.reply_to, envelope.stream, envelope.client_request_id)
        return _lenient_msgpack.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return ReturnHints()


def msgpack_decoder(payload_type: type[T]) -> msgspec.msgpack.Decoder[T]:
    return msgspec.msgpack.Decoder(payload_type)
