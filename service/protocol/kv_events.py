"""KV events on the wire: which prompt prefixes an engine's prefix cache holds, told to every
coordinator replica so that routing knows where a prompt's beginning is computed already
(docs/protocol.md, *KV events*). An extension of version 1; msgpack only, engines to
coordinators.

A prefix is named by its prefix hash (:mod:`service.protocol.prefix`), the hash the client
library and the coordinator compute for a submission, and measured in that hash chain's blocks
(16 token ids, or 64 bytes of text). An engine holds a prefix while its prefix cache holds the
KV of every token of it.

- ``<prefix>.kv_events.<engine_id>``: after a step that changed what it holds (or how many
  prompt tokens wait for their prefill), an engine publishes one :class:`KvEvents`: the
  prefixes it began to hold and those it stopped holding. Its messages are numbered 1, 2, 3, ...
  from its start (``sequence``), so a coordinator that misses one sees the gap.
- ``<prefix>.engine.<engine_id>.kv_snapshot``: a coordinator asks (body ``{}``) for a
  :class:`KvSnapshot`, every prefix held at the moment of the answer and the number of the last
  :class:`KvEvents` published before it, after a gap, and when it first meets the engine.
- ``kv_sequence`` in ``register`` and ``heartbeat`` (:mod:`service.protocol.membership`) is the
  number of the engine's last :class:`KvEvents` (0 before the first); absent, the engine
  publishes none (no prefix cache, or an earlier release) and is routed by load alone.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

# A prefix hash: an 8-byte BLAKE2b digest read as an unsigned little-endian integer (msgspec
# bounds only int64 ranges; a larger value simply names no prefix).
PrefixHash = Annotated[int, Meta(ge=0)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class HeldPrefix(Struct, array_like=True, gc=False):
    """A prefix an engine holds, ``[prefix_hash, blocks]``: ``blocks`` is the length of the
    prefix in the hash chain's blocks (the boundary its hash was taken at: 1, 2, 4, ..., or the
    prompt's last whole block)."""

    prefix_hash: PrefixHash
    blocks: Annotated[int, Meta(ge=1, le=2**31 - 1)]


class KvEvents(Struct, gc=False):
    """One engine step's changes: ``stored`` prefixes it holds from now on, ``evicted`` ones it
    no longer holds (a prefix leaves as soon as any of its blocks does), and ``queued_tokens``,
    the prompt tokens of its requests still waiting for their prefill (not counting those its
    prefix cache serves), so a burst is seen at the next step rather than the next heartbeat."""

    engine_id: str
    sequence: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    stored: list[HeldPrefix] = msgspec.field(default_factory=list)
    evicted: list[PrefixHash] = msgspec.field(default_factory=list)
    queued_tokens: Count = 0


class KvSnapshot(Struct):
    """An engine's answer to ``kv_snapshot``: what it holds after applying its events up to
    ``sequence`` and none after (0: it published none yet), most recently used last; an engine
    may leave out its least recently used prefixes to keep the answer under ``max_payload``."""

    engine_id: str
    sequence: Count
    held: list[HeldPrefix] = msgspec.field(default_factory=list)
    queued_tokens: Count = 0
