"""Error codes of the wire contract and the exception that carries them inside Python."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    MALFORMED = 400
    FORBIDDEN = 403
    NOT_FOUND = 404
    STALLED = 408  # a stream whose reader took nothing for the stall limit (service/client/flow.py)
    CONFLICT = 409
    TOO_LARGE = 413
    OVERLOADED = 429
    INTERNAL = 500
    BROKEN_STREAM = 502  # a stream whose final does not extend its partials (service/protocol/streams.py)
    NO_ENGINE = 503
    TIMED_OUT = 504


class WireError(Exception):
    """An error that becomes an ``{"type": "error"}`` reply to whoever sent the message."""

    def __init__(self, code: ErrorCode | int, message: str) -> None:
        super().__init__(f"{int(code)}: {message}")
        self.code = int(code)
        self.message = message
