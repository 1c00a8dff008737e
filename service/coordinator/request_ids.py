"""Request ids no one can guess: ``<coordinator_id>-<24 hex digits>``, 96 random bits each.

A request id is all an abort by ``request_id`` needs, and engine replies name the request they
answer, so a counter (``<coordinator_id>-<n>``, with the coordinator id in every
``connect_ack``) let anyone abort or answer other clients' requests. The bits come from the
operating system's CSPRNG, drawn a block at a time so one id costs a slice, not a system call.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

ID_HEX_DIGITS = 24
_IDS_PER_DRAW = 256


def request_ids(coordinator_id: str) -> Iterator[str]:
    """Endless fresh request ids of ``coordinator_id`` (``next`` draws one)."""
    prefix = f"{coordinator_id}-"
    while True:
        block = os.urandom(_IDS_PER_DRAW * ID_HEX_DIGITS // 2).hex()
        yield from [prefix + block[start : start + ID_HEX_DIGITS] for start in range(0, len(block), ID_HEX_DIGITS)]
