"""Request ids no one can guess: ``<coordinator_id>-<24 hex digits>``, 96 random bits each.

A request id is all an abort by ``request_id`` needs, and engine replies name the request they
answer, so a counter (``<coordinator_id>-<n>``, with the coordinator id in every
``connect_ack``) let anyone abort or answer other clients' requests. The bits come from the
operating system's CSPRNG, drawn a block at a time so one id costs a slice, not a system call.
"""

from __future__ import annotations

import os

ID_HEX_DIGITS = 24
_IDS_PER_DRAW = 256


class RequestIds:
    __slots__ = ("_block", "_next", "_prefix")

    def __init__(self, coordinator_id: str) -> None:
        self._prefix = f"{coordinator_id}-"
        self._block = ""
        self._next = 0

    def new(self) -> str:
        start = self._next
        if start >= len(self._block):
            self._block = os.urandom(_IDS_PER_DRAW * ID_HEX_DIGITS // 2).hex()
            start = 0
        self._next = start + ID_HEX_DIGITS
        return self._prefix + self._block[start : start + ID_HEX_DIGITS]
