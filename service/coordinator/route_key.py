"""What a routing policy needs of a submission beyond the fleet's loads: its prompt's prefix
hashes, and for ``cache_aware`` its session and group.

A key is read once, at admission, and kept with the request (a requeued request is routed
again by the same key). An envelope carries its prefix hashes, so the coordinator never
decodes a prompt for them; a plain submission, which it decodes anyway, has them computed.
"""

from __future__ import annotations

from collections.abc import Sequence

from msgspec import Struct

from service.protocol.messages import SubmitEnvelope, SubmitRequest
from service.protocol.prefix import TOKENS_PER_BLOCK, prefix_hashes


class RouteKey(Struct, gc=False):
    """``hashes``: the prompt's prefix hashes, shortest first (empty: no whole block);
    ``session_id`` and ``group_id``: the submission's, if any."""

    hashes: Sequence[int]
    session_id: str | None = None
    group_id: str | None = None


def hashes_of(submit: SubmitRequest | SubmitEnvelope) -> Sequence[int]:
    """The prompt's prefix hashes: the envelope's, or computed from a plain submission. A prompt
    under ``TOKENS_PER_BLOCK`` (16) items has none, uncomputed: fewer token ids than a block
    holds, or fewer characters than a text block's 64 bytes of UTF-8 (at most 4 a character)."""
    if isinstance(submit, SubmitEnvelope):
        return submit.prefix_hashes or ()
    prompt = submit.prompt
    if prompt is not None and len(prompt) < TOKENS_PER_BLOCK:
        return ()
    return prefix_hashes(prompt, submit.messages)


def prefix_blocks(index: int, count: int) -> int:
    """The length in blocks of the prefix named by hash ``index`` of ``count``: hashes are taken
    at 1, 2, 4, ... blocks and at the prompt's last whole block (docs/protocol.md). The last one's
    length is unknown from the hashes alone: it lies past the one before, so one block more than
    that is taken, a lower bound (an engine's KV events give the exact length of what it holds,
    and how many tokens wait for their prefill, so an estimate too low lasts one engine step;
    one too high would make a session's turn look like a long prefill)."""
    if index < count - 1 or count <= 2:
        return 1 << index
    return (1 << (index - 1)) + 1
