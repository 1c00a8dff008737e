"""A prefix cache and its KV events, written from docs/protocol.md alone (*Prefix hashes*, *KV
events*) for the engines of benchmarks/doc_engines.py: no import from this project, msgpack by
hand, so a coordinator that follows these engines follows any engine written from the page.

What the page says an engine with a prefix cache does, and this one does:

- name each prefix of a prompt as submitted by its prefix hash: the prompt cut into blocks (16
  token ids as 4-byte little-endian, or 64 bytes of UTF-8 text, or of chat messages as
  ``role NUL content NUL``), a BLAKE2b-64 digest chained over the bytes since the previous one
  from ``b"t"``, ``b"s"`` or ``b"c"``, taken after 1, 2, 4, ... blocks and after the last whole
  block, at most 16, read as unsigned little-endian integers; ``blocks`` is where it was taken;
- after a step that changed what it holds, publish ``{engine_id, sequence, stored: [[hash,
  blocks], ...], evicted: [hash, ...], queued_tokens}`` on ``<prefix>.kv_events.<engine_id>``,
  numbered 1, 2, 3, ... (only prefixes it did not hold already, and only those it stopped holding);
- put ``kv_sequence`` (the last number, 0 before the first) in ``register`` and ``heartbeat``;
- answer ``<prefix>.engine.<engine_id>.kv_snapshot`` with ``{engine_id, sequence, held, queued_tokens}``.

The cache holds every prefix of the last ``prompts`` prompts run (least recently run forgotten
first); a prompt is run, so its prefixes held, when it arrives (these engines answer at once:
nothing waits for a prefill, ``queued_tokens`` is 0).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Any


def prefixes(prompt: Any, messages: Any = None) -> list[tuple[int, int]]:
    """``[(prefix_hash, blocks), ...]`` of a submission's ``prompt`` or chat ``messages``."""
    if isinstance(prompt, list):
        data, size, digest = struct.pack(f"<{len(prompt)}I", *prompt), 64, b"t"
    elif isinstance(prompt, str):
        data, size, digest = prompt.encode(), 64, b"s"
    elif messages:
        data, size, digest = "".join(f"{m['role']}\0{m['content']}\0" for m in messages).encode(), 64, b"c"
    else:
        return []
    whole = len(data) // size
    ends = [1 << k for k in range(15) if 1 << k <= whole]
    if whole and ends[-1] != whole:
        ends.append(whole)
    found: list[tuple[int, int]] = []
    start = 0
    for end in ends:
        digest = hashlib.blake2b(digest + data[start * size : end * size], digest_size=8).digest()
        found.append((int.from_bytes(digest, "little"), end))
        start = end
    return found


class DocPrefixCache:
    def __init__(self, prompts: int = 256) -> None:
        self.prompts = prompts
        self.sequence = 0  # of the last event published
        self._runs: OrderedDict[int, list[tuple[int, int]]] = OrderedDict()  # by last hash, oldest first
        self._holders: dict[int, int] = {}  # prefix hash -> prompts cached that have it
        self._blocks: dict[int, int] = {}  # prefix hash -> blocks
        self._published: dict[int, int] = {}  # prefix hash -> blocks, as the events told it
        self._changed: set[int] = set()

    def ran(self, found: list[tuple[int, int]]) -> None:
        if not found:
            return
        key = found[-1][0]
        if key in self._runs:
            self._runs.move_to_end(key)
            return
        self._runs[key] = found
        for prefix_hash, blocks in found:
            self._holders[prefix_hash] = self._holders.get(prefix_hash, 0) + 1
            self._blocks[prefix_hash] = blocks
            self._changed.add(prefix_hash)
        while len(self._runs) > self.prompts:
            for prefix_hash, _ in self._runs.popitem(last=False)[1]:
                self._holders[prefix_hash] -= 1
                if not self._holders[prefix_hash]:
                    del self._holders[prefix_hash], self._blocks[prefix_hash]
                self._changed.add(prefix_hash)

    def events(self, engine_id: str) -> dict[str, Any] | None:
        """The next numbered event, or None when nothing changed."""
        stored, evicted = [], []
        for prefix_hash in self._changed:
            if prefix_hash in self._holders and prefix_hash not in self._published:
                self._published[prefix_hash] = self._blocks[prefix_hash]
                stored.append([prefix_hash, self._blocks[prefix_hash]])
            elif prefix_hash not in self._holders and prefix_hash in self._published:
                del self._published[prefix_hash]
                evicted.append(prefix_hash)
        self._changed.clear()
        if not stored and not evicted:
            return None
        self.sequence += 1
        return {
            "engine_id": engine_id,
            "sequence": self.sequence,
            "stored": stored,
            "evicted": evicted,
            "queued_tokens": 0,
        }

    def snapshot(self, engine_id: str) -> dict[str, Any]:
        held = [[prefix_hash, blocks] for prefix_hash, blocks in self._published.items()]
        return {"engine_id": engine_id, "sequence": self.sequence, "held": held, "queued_tokens": 0}
