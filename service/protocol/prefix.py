"""Prefix hashes: what prefix-aware routing knows of a prompt (docs/protocol.md, "Prefix hashes").

A prompt is cut into blocks: 16 token ids of a token prompt, or 64 bytes of a text prompt's
UTF-8. Chat ``messages`` count as the text ``role NUL content NUL`` of each message in turn, so
conversations that open alike share prefixes. Hashes are taken at the ends of the first 1, 2, 4, 8, ... blocks, and at the end of
the prompt's last whole block, at most ``MAX_PREFIX_HASHES`` of them, shortest first. Each
hash is chained: the BLAKE2b digest (8 bytes) of the previous digest followed by the bytes up
to its end since the previous one, so it stands for everything before it. Token ids count as
4 bytes each, unsigned little-endian; the chain starts from ``b"t"`` for token prompts and
``b"s"`` for text and ``b"c"`` for chat messages, so prompts of different kinds never share a
hash. On the wire a hash is the
digest read as an unsigned little-endian 64-bit integer.

The client library and the coordinator compute the same values, so submissions with and
without the envelope share prefixes. Block sizes need not match an engine's KV pages: a hash
only names a prefix, and routing sends equal prefixes to the same engines.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import Protocol

TOKENS_PER_BLOCK = 16
BYTES_PER_BLOCK = 64
MAX_PREFIX_HASHES = 16

# An array type code of 4-byte items: "I" on every common platform.
_UINT32 = next(code for code in ("I", "L") if array(code).itemsize == 4)


class ChatTurn(Protocol):
    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


def prefix_hashes(prompt: str | list[int] | None, messages: Sequence[ChatTurn] | None = None) -> list[int]:
    """The prefix hashes of ``prompt``, or of chat ``messages`` when there is no prompt; empty
    when there is no whole block (or a token id over 32 bits)."""
    return _chain(prompt, messages)[0]


def prompt_prefixes(
    prompt: str | list[int] | None, messages: Sequence[ChatTurn] | None = None
) -> list[tuple[int, int]]:
    """Each prefix hash of :func:`prefix_hashes` with the length in blocks of the prefix it
    names (the boundary it was taken at: 1, 2, 4, ..., or the last whole block), as an engine
    reports what it holds (docs/protocol.md, *KV events*)."""
    hashes, ends = _chain(prompt, messages)
    return list(zip(hashes, ends, strict=True))


def _chain(prompt: str | list[int] | None, messages: Sequence[ChatTurn] | None) -> tuple[list[int], list[int]]:
    """The prefix hashes and the block counts they were taken at."""
    if prompt is None:
        if not messages:
            return [], []
        data = "".join(f"{message.role}\0{message.content}\0" for message in messages).encode()
        block = BYTES_PER_BLOCK
        digest = b"c"
    elif isinstance(prompt, str):
        data = prompt.encode()
        block = BYTES_PER_BLOCK
        digest = b"s"
    else:
        try:
            ids = array(_UINT32, prompt)
        except OverflowError:
            return [], []
        if sys.byteorder != "little":
            ids.byteswap()
        data = ids.tobytes()
        block = TOKENS_PER_BLOCK * 4
        digest = b"t"
    ends = _boundaries(len(data) // block)
    hashes: list[int] = []
    start = 0
    for end in ends:
        digest = blake2b(digest + data[start * block : end * block], digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        start = end
    return hashes, ends


def _boundaries(blocks: int) -> list[int]:
    """Block counts at which a hash is taken: powers of two, then the last whole block."""
    ends: list[int] = []
    end = 1
    while end <= blocks and len(ends) < MAX_PREFIX_HASHES - 1:
        ends.append(end)
        end *= 2
    if blocks and ends[-1] != blocks:
        ends.append(blocks)
    return ends
