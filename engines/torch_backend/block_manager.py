"""KV-cache pages: allocation, reference counts and the prefix cache, free of torch.

A page is in one of three states:

- **in use**: referenced by running sequences (``ref >= 1``); never handed out or evicted.
- **cached**: no reference left, but it holds the keys and values of a known token prefix (it
  has a hash); kept for reuse, least recently released first in line for eviction.
- **blank**: no reference and no hash.

Free pages are the blank and the cached ones. A page is handed out blank if one is left, else
the least recently released cached page is evicted (its hash forgotten) and handed out.

Prefix caching, as vLLM and nano-vllm do it: once a full page's keys and values are written,
the page is registered under a hash chained over token content,
``hash(page i) = blake2b(hash(page i - 1) || tokens of page i)``, so equal hashes mean equal
token prefixes, not merely equal pages. A sequence being admitted takes a reference on every
registered page that matches its leading full pages and feeds only the tokens after them. Its
last token is always fed (its logits give the next token): when every page up to the one
holding it is cached (the samples of one prompt, page-aligned), that token alone is fed and
its keys and values, which the page holds already, are written to the scratch page instead
(``Sequence.num_committed`` marks the pages fed tokens must not be written to). Since only
full pages are shared, nothing ever writes to a shared page. A sequence whose prompt logprobs are asked for reuses
nothing (``Sequence.prompt_logits``): its whole prompt is recomputed, since cached pages keep
keys and values but no logits; the pages it fills are registered for the others as usual.

A :class:`PageWatcher` (the backend's map of prompt prefixes, for KV events) is told each hash
as it enters the prefix cache (a page registered) and leaves it (a cached page evicted, or the
cache cleared), as it happens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Protocol

from engines.backend import PrefixCacheStats
from engines.torch_backend.sequence import Sequence


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a full page: its tokens, chained onto the hash of the page before it."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PageWatcher(Protocol):
    def registered(self, page_hash: bytes) -> None:
        """A page holding the prefix ``page_hash`` names joined the prefix cache."""

    def evicted(self, page_hash: bytes) -> None:
        """The page holding the prefix ``page_hash`` names left it."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._blank: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, hashed; oldest release first
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._evicted_pages = 0
        self.watcher: PageWatcher | None = None  # told what enters and leaves the prefix cache

    @property
    def num_free(self) -> int:
        return len(self._blank) + len(self._cached)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page_hash: bytes) -> bool:
        """Whether a page holding the prefix ``page_hash`` names is in the prefix cache."""
        return page_hash in self._by_hash

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self._queried_tokens, self._hit_tokens, len(self._by_hash), self._evicted_pages, self.num_blocks
        )

    # ------------------------------------------------------------ admission

    def match(self, sequence: Sequence) -> list[int]:
        """Registered pages holding the sequence's leading full pages, in order (no side effect)."""
        reusable = self.reusable(sequence)
        if not reusable:
            return []
        self.hash_pages(sequence, reusable)
        hits: list[int] = []
        for page_hash in sequence.page_hashes[:reusable]:
            page = self._by_hash.get(page_hash)
            if page is None:
                break
            hits.append(page)
        return hits

    def reusable(self, sequence: Sequence) -> int:
        """How many of the sequence's leading full pages a cached copy may serve: every full
        page (its last token is fed even so); none with prefix caching off or for a sequence
        that wants its prompt's logits."""
        if not self.prefix_caching or sequence.prompt_logits:
            return 0
        return len(sequence.token_ids) // self.block_size

    def cached_length(self, sequence: Sequence, hits: list[int]) -> int:
        """The tokens of ``sequence`` its cached pages ``hits`` spare it feeding: all they hold
        but its last token, which is always fed."""
        return min(len(hits) * self.block_size, len(sequence.token_ids) - 1)

    def can_admit(self, sequence: Sequence, hits: list[int]) -> bool:
        """Whether a sequence without pages fits, reusing ``hits`` (a cached hit leaves the free pool)."""
        revived = sum(1 for page in hits if self._refs[page] == 0)
        return self.blocks_for(len(sequence.token_ids)) - len(hits) + revived <= self.num_free

    def admit(self, sequence: Sequence, hits: list[int]) -> None:
        """Give a sequence without pages its cached prefix and pages for the rest; callers check
        :meth:`can_admit` first."""
        if sequence.block_table:
            raise RuntimeError(f"request_id={sequence.request_id}: admitted while holding pages")
        for page in hits:
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
        sequence.block_table = list(hits)
        sequence.num_committed = len(hits)
        sequence.num_cached = self.cached_length(sequence, hits)
        self._queried_tokens += len(sequence.token_ids)
        self._hit_tokens += sequence.num_cached
        self.grow(sequence, len(sequence.token_ids))

    # ------------------------------------------------------------ growth and release

    def can_hold(self, sequence: Sequence, num_tokens: int) -> bool:
        """Whether ``sequence`` can grow to ``num_tokens`` tokens with the pages free now."""
        return self.blocks_for(num_tokens) - len(sequence.block_table) <= self.num_free

    def grow(self, sequence: Sequence, num_tokens: int) -> None:
        """Give ``sequence`` pages for ``num_tokens`` tokens; callers check :meth:`can_hold` first."""
        missing = self.blocks_for(num_tokens) - len(sequence.block_table)
        if missing > self.num_free:
            raise RuntimeError(f"request_id={sequence.request_id}: {missing} pages needed, {self.num_free} free")
        sequence.block_table.extend(self._take_free() for _ in range(missing))

    def commit(self, sequence: Sequence) -> None:
        """Register the sequence's full pages whose keys and values are now written. A page
        whose content another page already holds stays unregistered (and blank once released)."""
        if not self.prefix_caching:
            return
        full = sequence.num_cached // self.block_size
        if full <= sequence.num_committed:
            return
        self.hash_pages(sequence, full)
        watcher = self.watcher
        for index in range(sequence.num_committed, full):
            page_hash = sequence.page_hashes[index]
            if page_hash not in self._by_hash:
                page = sequence.block_table[index]
                self._by_hash[page_hash] = page
                self._hashes[page] = page_hash
                if watcher is not None:
                    watcher.registered(page_hash)
        sequence.num_committed = full

    def release(self, sequence: Sequence) -> None:
        """Drop the sequence's references; its registered pages stay cached for the next user.
        Tail pages are released first, so they are evicted before the prefix they extend."""
        for page in reversed(sequence.block_table):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self._hashes[page] is None:
                    self._blank.append(page)
                else:
                    self._cached[page] = None
        sequence.block_table = []
        sequence.num_cached = 0
        sequence.num_committed = 0

    def clear(self) -> None:
        """Forget every cached prefix: the cache's contents are gone (suspend). No page may be in use."""
        if any(self._refs):
            raise RuntimeError("the prefix cache is cleared while pages are in use")
        if self.watcher is not None:
            for page_hash in self._by_hash:
                self.watcher.evicted(page_hash)
        self._by_hash.clear()
        self._hashes = [None] * self.num_blocks
        self._cached.clear()
        self._blank = deque(range(self.num_blocks))

    # ------------------------------------------------------------ internals

    def _take_free(self) -> int:
        if self._blank:
            page = self._blank.popleft()
        else:
            page, _ = self._cached.popitem(last=False)
            page_hash = self._hashes[page]
            assert page_hash is not None, "a cached page has a hash"
            del self._by_hash[page_hash]
            self._hashes[page] = None
            self._evicted_pages += 1
            if self.watcher is not None:
                self.watcher.evicted(page_hash)
        self._refs[page] = 1
        return page

    def hash_pages(self, sequence: Sequence, count: int) -> None:
        """Extend ``sequence.page_hashes`` to its first ``count`` full pages."""
        hashes, size, tokens = sequence.page_hashes, self.block_size, sequence.token_ids
        while len(hashes) < count:
            index = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else b"", tokens[index * size : (index + 1) * size]))
