"""The block index: which engines hold which prompt prefixes, from the engines' KV events
(docs/protocol.md, *KV events*), plus the prefixes routing predicts they are about to hold.

Contract:
- A prefix is its prefix hash (:mod:`service.protocol.prefix`); an engine holds it from the
  KV event that stored it until the one that evicted it, or until a snapshot that lacks it.
- Routing predicts: the prompt of a request just routed counts as held by its engine for
  ``ttl_s`` (:meth:`BlockIndex.predict`), so the siblings of a burst follow the first before
  its prefill ended and the engine said so. A prediction never shadows what an engine said.
- :meth:`BlockIndex.matches` finds, for a prompt's hashes, the engines holding its longest
  prefix, longest first, reading at most ``limit`` holders per hash: O(hashes × limit),
  whatever the fleet's size.
- Bounded: at most ``max_entries`` (engine, prefix) pairs held, shared evenly among the
  engines that publish events (an engine over its share forgets its oldest first), and at
  most ``max_entries`` predictions (the oldest expire first).

The sequence bookkeeping of each engine (:class:`EngineBlocks`) is :mod:`.kv_feed`'s, and so is
``learning`` (a replica that just started, still learning what the engines hold): this module
only holds them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice

from service.coordinator.pool import EngineRecord
from service.coordinator.route_key import prefix_blocks
from service.protocol.kv_events import HeldPrefix, KvEvents

HELD = math.inf  # a holder's expiry when its engine said it holds the prefix


class EngineBlocks:
    """One engine in the index: the prefixes it said it holds (oldest first), and where its
    numbered events stand (:mod:`.kv_feed`)."""

    __slots__ = ("buffered", "engine_id", "held", "overflowed", "pending", "record", "sequence")

    def __init__(self, engine_id: str, record: EngineRecord) -> None:
        self.engine_id = engine_id
        self.record = record  # the pool's record it routes to; a new one when the engine registers again
        self.held: dict[int, None] = {}
        self.sequence: int | None = None  # the last event applied; None until a snapshot answered
        self.pending = False  # a snapshot was asked and not answered yet
        self.buffered: list[KvEvents] = []  # events that arrived while it was pending
        self.overflowed = False  # more arrived than the buffer holds: ask again once answered


class _Prefix:
    __slots__ = ("blocks", "holders")

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks  # its length in the hash chain's blocks
        self.holders: dict[EngineBlocks, float] = {}  # engine -> expiry (HELD), most recent last


class BlockIndex:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self.engines: dict[str, EngineBlocks] = {}
        self._prefixes: dict[int, _Prefix] = {}
        self._predictions: deque[tuple[float, int, EngineBlocks]] = deque()  # oldest first
        self.entries = 0  # (engine, prefix) pairs held
        self.learning = False  # this replica just started: the engines' snapshots are not all in

    # ------------------------------------------------------------ engines

    def track(self, engine_id: str, record: EngineRecord) -> EngineBlocks:
        """A fresh entry for ``engine_id``, which publishes events; an earlier one is forgotten."""
        self.forget(engine_id)
        engine = self.engines[engine_id] = EngineBlocks(engine_id, record)
        return engine

    def forget(self, engine_id: str) -> None:
        engine = self.engines.pop(engine_id, None)
        if engine is not None:
            self._drop_all(engine)

    # ------------------------------------------------------------ what engines say

    def store(self, engine: EngineBlocks, stored: Iterable[HeldPrefix]) -> None:
        prefixes = self._prefixes
        held = engine.held
        share = max(1, self._max_entries // max(1, len(self.engines)))
        for item in stored:
            prefix_hash = item.prefix_hash
            prefix = prefixes.get(prefix_hash)
            if prefix is None:
                prefix = prefixes[prefix_hash] = _Prefix(item.blocks)
            else:
                prefix.blocks = item.blocks
            holders = prefix.holders
            holders.pop(engine, None)  # a prediction becomes what the engine said; the most recent
            holders[engine] = HELD
            if prefix_hash in held:
                del held[prefix_hash]  # stored again: the most recent
            else:
                self.entries += 1
            held[prefix_hash] = None
            while len(held) > share:
                self._drop(engine, next(iter(held)))

    def evict(self, engine: EngineBlocks, evicted: Iterable[int]) -> None:
        held = engine.held
        for prefix_hash in evicted:
            if prefix_hash in held:
                self._drop(engine, prefix_hash)

    def replace(self, engine: EngineBlocks, held: Iterable[HeldPrefix]) -> None:
        """A snapshot: ``engine`` holds exactly ``held`` (its predictions stand)."""
        self._drop_all(engine)
        self.store(engine, held)

    def _drop(self, engine: EngineBlocks, prefix_hash: int) -> None:
        del engine.held[prefix_hash]
        self.entries -= 1
        prefix = self._prefixes.get(prefix_hash)
        if prefix is not None and prefix.holders.get(engine) == HELD:
            del prefix.holders[engine]
            if not prefix.holders:
                del self._prefixes[prefix_hash]

    def _drop_all(self, engine: EngineBlocks) -> None:
        for prefix_hash in list(engine.held):
            self._drop(engine, prefix_hash)

    # ------------------------------------------------------------ routing

    def matches(self, hashes: Sequence[int], now: float, limit: int) -> dict[EngineBlocks, int]:
        """Engines holding a prefix of the prompt whose ``hashes`` these are (shortest first),
        each with the length in blocks of the longest one it holds; at most ``limit`` holders
        are read per hash, the most recent first, and at most ``limit`` engines are returned
        (fewer when fewer engines publish events). An engine that holds a prefix holds the
        shorter ones too (its events and routing's predictions store them together), so a
        shorter prefix with as many holders as a longer one whose holders were all current has
        the same holders: it is skipped, and so are all the shorter ones once the shortest has
        that many; and once ``limit`` engines hold a prefix, the shorter ones are not read."""
        found: dict[EngineBlocks, int] = {}
        prefixes = self._prefixes
        limit = min(limit, len(self.engines))
        shortest = prefixes.get(hashes[0]) if hashes else None
        most = len(shortest.holders) if shortest is not None else 0  # holders of the shortest prefix
        same = -1  # holders of the last prefix whose holders were all read and current
        for index in range(len(hashes) - 1, -1, -1):
            prefix = prefixes.get(hashes[index])
            if prefix is None:
                continue
            holders = prefix.holders
            count = len(holders)
            if count == same:
                continue
            same = count
            blocks = prefix.blocks
            recent = reversed(holders.items())
            for engine, expiry in recent if count <= limit else islice(recent, limit):
                if expiry <= now:
                    same = -1
                elif engine not in found:
                    found[engine] = blocks
                    if len(found) >= limit:
                        return found
            if same == count and (count >= limit or count == most):
                return found  # enough current holders of this longer prefix, or the shorter ones are the same
        return found

    def held_blocks(self, engine: EngineBlocks, hashes: Sequence[int], now: float) -> int:
        """The length in blocks of the longest prefix of ``hashes`` that ``engine`` holds (0: none)."""
        prefixes = self._prefixes
        for index in range(len(hashes) - 1, -1, -1):
            prefix = prefixes.get(hashes[index])
            if prefix is not None and prefix.holders.get(engine, 0.0) > now:
                return prefix.blocks
        return 0

    def predict(self, engine: EngineBlocks, hashes: Sequence[int], now: float) -> None:
        """``engine`` was just given a prompt with these prefix ``hashes``: count them as held
        by it for the TTL, unless it said so already. Longest first, down to the first it holds
        or was predicted to hold within half a TTL (the shorter ones came with that one), so a
        burst of siblings predicts little but its own ends."""
        predictions = self._predictions
        if predictions and predictions[0][0] <= now:
            self._expire(now)
        expiry = now + self._ttl_s
        fresh = now + self._ttl_s / 2
        prefixes = self._prefixes
        count = len(hashes)
        for index in range(count - 1, -1, -1):
            prefix_hash = hashes[index]
            prefix = prefixes.get(prefix_hash)
            if prefix is None:
                prefix = prefixes[prefix_hash] = _Prefix(prefix_blocks(index, count))
            holders = prefix.holders
            current = holders.get(engine)
            if current is not None:
                if current > fresh:
                    break  # held, or predicted a moment ago, with every shorter prefix
                del holders[engine]
            holders[engine] = expiry  # the most recent holder
            predictions.append((expiry, prefix_hash, engine))
        while len(predictions) > self._max_entries:
            self._unpredict(*predictions.popleft())

    def _expire(self, now: float) -> None:
        predictions = self._predictions
        while predictions and predictions[0][0] <= now:
            self._unpredict(*predictions.popleft())

    def _unpredict(self, expiry: float, prefix_hash: int, engine: EngineBlocks) -> None:
        prefix = self._prefixes.get(prefix_hash)
        if prefix is not None and prefix.holders.get(engine) == expiry:
            del prefix.holders[engine]
            if not prefix.holders:
                del self._prefixes[prefix_hash]

    @property
    def predictions(self) -> int:
        return len(self._predictions)

    def __len__(self) -> int:
        """Prefixes known, held or predicted."""
        return len(self._prefixes)
