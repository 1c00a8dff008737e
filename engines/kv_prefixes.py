"""The prefixes this engine told the coordinators it holds, and the number of its last KV event
(docs/protocol.md, *KV events*).

Contract: :class:`PublishedPrefixes` is the one owner of ``kv_sequence`` and of the published
set. :meth:`PublishedPrefixes.events` turns a backend's changes (:class:`~engines.backend.CacheChanges`)
into the next numbered :class:`~service.protocol.kv_events.KvEvents`, applying them to the set as
every coordinator will (evicted, then stored; a prefix stored while published already, or
evicted while not, is left out), or returns None when nothing changed (no prefix stored or
evicted, the same queued tokens): numbers are never skipped nor reused. :meth:`snapshot` answers
from that set alone, so it is exactly the state after events ``1..sequence`` whatever the
backend did since: least recently stored first, the oldest left out beyond ``max_entries``.
"""

from __future__ import annotations

from itertools import islice

from engines.backend import CacheChanges
from service.protocol.kv_events import HeldPrefix, KvEvents, KvSnapshot


class PublishedPrefixes:
    def __init__(self, engine_id: str) -> None:
        self._engine_id = engine_id
        self.sequence = 0  # of the last KvEvents published; 0 before the first
        self._held: dict[int, int] = {}  # prefix hash -> blocks, least recently stored first
        self._queued_tokens = 0

    def __len__(self) -> int:
        return len(self._held)

    def events(self, changes: CacheChanges) -> KvEvents | None:
        """The next message, numbered, for ``changes``; None when they change nothing published."""
        held = self._held
        evicted = [prefix_hash for prefix_hash in changes.evicted if held.pop(prefix_hash, None) is not None]
        stored: list[HeldPrefix] = []
        for prefix_hash, blocks in changes.stored:
            if prefix_hash not in held:
                held[prefix_hash] = blocks
                stored.append(HeldPrefix(prefix_hash, blocks))
        queued_tokens = changes.queued_tokens
        if not evicted and not stored and queued_tokens == self._queued_tokens:
            return None
        self._queued_tokens = queued_tokens
        self.sequence += 1
        return KvEvents(self._engine_id, self.sequence, stored, evicted, queued_tokens)

    def snapshot(self, max_entries: int) -> KvSnapshot:
        """What the events published so far say this engine holds, the most recent ``max_entries``."""
        held = self._held
        skip = max(0, len(held) - max_entries)
        items = [HeldPrefix(prefix_hash, blocks) for prefix_hash, blocks in islice(held.items(), skip, None)]
        return KvSnapshot(self._engine_id, self.sequence, items, self._queued_tokens)
