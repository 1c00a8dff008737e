"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the HTTP
status each wire error code maps to.

| wire code | HTTP | type |
|---|---|---|
| 400 | 400 | invalid_request_error |
| 403 | 403 | permission_error |
| 404 | 404 | not_found_error (code ``model_not_found`` for an unknown model) |
| 408 | 408 | invalid_request_error (code ``stream_stalled``: the client read nothing of a held stream for ``gateway_stream_stall_s``; raised by the client library) |
| 409 | 409 | conflict_error |
| 413 | 413 | invalid_request_error (code ``payload_too_large``) |
| 429 | 429 | rate_limit_error, with ``Retry-After`` |
| 500 | 500 | internal_error |
| 502 | 502 | bad_gateway (a stream whose final does not extend its partials; raised by the client library) |
| 503 | 503 | service_unavailable |
| 504 | 504 | timeout_error |

A client library timeout (no reply at all) is 504 too; a refused API key is 401. The HTTP edge
answers 404 (no such route), 405 (a method the route does not serve), 408 (the head or body did
not arrive in time), 415 (a body that is not JSON), 431 (too many or too large header fields)
and 503 (too many connections) in the same shape.
"""

from __future__ import annotations

import re

import msgspec

from service.gateway.schemas import ErrorDetail, ErrorResponse, json_encoder
from service.protocol.errors import ErrorCode

# Seconds a client told 429 should wait before trying again.
RETRY_AFTER_S = 1

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout_error",
}
_FIELD_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


class GatewayError(Exception):
    """An error answered to the HTTP client; ``status`` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self._headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "internal_error")

    def body(self) -> bytes:
        return json_encoder.encode(ErrorResponse(ErrorDetail(self.message, self.type, self.param, self.code)))

    def headers(self) -> dict[str, str]:
        if self.status == ErrorCode.OVERLOADED:
            return {"Retry-After": str(RETRY_AFTER_S), **self._headers}
        return self._headers


def from_wire(code: int, message: str) -> GatewayError:
    """The HTTP error for a wire error reply; unknown codes are 500."""
    status = code if code in _TYPES else ErrorCode.INTERNAL
    error_code = None
    if status == ErrorCode.NOT_FOUND and message.startswith("model "):
        return GatewayError(status, message, "model", "model_not_found")
    if status == ErrorCode.TOO_LARGE:
        error_code = "payload_too_large"
    elif status == ErrorCode.STALLED:
        error_code = "stream_stalled"
    return GatewayError(status, message, None, error_code)


def from_validation(exc: msgspec.ValidationError | msgspec.DecodeError | RecursionError, body: bytes) -> GatewayError:
    """A 400 naming the field msgspec complained about (for nesting too deep to decode, the
    top-level field whose value nests deepest)."""
    if isinstance(exc, RecursionError):
        deepest = deepest_field(body)
        return GatewayError(400, f"the value of {deepest or 'the body'} nests too deeply", deepest)
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return GatewayError(400, f"the body is not valid JSON: {text}")
    unknown = _UNKNOWN_FIELD.search(text)
    if unknown is not None:
        inside = _FIELD_PATH.search(text)
        name = f"{inside.group(1)}.{unknown.group(1)}" if inside is not None else unknown.group(1)
        return GatewayError(400, f"unrecognized request argument supplied: {name}", name)
    field = _FIELD_PATH.search(text) or _MISSING_FIELD.search(text)
    return GatewayError(400, text, field.group(1) if field else None)


def deepest_field(body: bytes) -> str | None:
    """The top-level key of a JSON object whose value nests deepest (only on the error path: it
    walks the body byte by byte)."""
    depth, deepest, best = 0, 0, None
    key: str | None = None
    in_string = escaped = False
    start = 0
    for at, byte in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # closing quote
                in_string = False
                if depth == 1:
                    key = body[start:at].decode("utf-8", "replace")
        elif byte == 0x22:
            in_string, start = True, at + 1
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest, best = depth, key
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return best
