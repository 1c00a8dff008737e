"""Which prompt prefixes the prefix cache holds, named as routing names them, free of torch: the
torch backend's side of KV events (docs/protocol.md, *KV events*).

A prefix (:class:`~engines.backend.PromptPrefix`) of ``tokens`` prompt tokens is held while the
prefix cache holds the first ``tokens // block_size`` full pages of its prompt: a request that
starts with it then finds every one of those pages (the few tokens of a partial last page it
computes anyway, so the prefix is never said to be held when a page of it is gone). A prefix
shorter than a page is never held. The block manager tells :class:`HeldPrefixes` (its
:class:`~engines.torch_backend.block_manager.PageWatcher`) each page hash as it enters and
leaves the cache; each prefix counts the pages it misses.

Contract: a prefix is known while a request that has it is in the backend (:meth:`watch`,
:meth:`unwatch`), and after that while it is held, up to ``max_idle`` such prefixes (the least
recently released forgotten first, as evicted): memory is bounded by the requests and the
cache. :meth:`drain` says which prefixes began and stopped being held since it last drained,
comparing each with its state then, so a prefix that came and went in between is not reported.
Not thread-safe: the request table calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class _Prefix:
    blocks: int
    pages: tuple[bytes, ...]  # the hashes of the pages it needs, in order
    missing: int  # of those, not in the cache now
    requests: int = 0  # requests in the backend that have it


class HeldPrefixes:
    def __init__(self, is_cached: Callable[[bytes], bool], max_idle: int) -> None:
        self._is_cached = is_cached
        self._max_idle = max_idle
        self._prefixes: dict[int, _Prefix] = {}
        self._needed_by: dict[bytes, set[int]] = {}  # page hash -> the prefixes that need it
        self._idle: OrderedDict[int, None] = OrderedDict()  # held, no request has them; least recent first
        self._by_request: dict[str, tuple[int, ...]] = {}
        self._before: dict[int, bool] = {}  # prefix hash -> whether it was held at the last drain

    def __len__(self) -> int:
        """Prefixes known."""
        return len(self._prefixes)

    def held(self, prefix_hash: int) -> bool:
        prefix = self._prefixes.get(prefix_hash)
        return prefix is not None and prefix.missing == 0

    # ------------------------------------------------------------ requests

    def watch(self, request_id: str, prefixes: Iterable[tuple[int, int, tuple[bytes, ...]]]) -> None:
        """A request entered the backend with these ``(prefix_hash, blocks, page hashes)``; those
        without a page are left out."""
        watched: list[int] = []
        for prefix_hash, blocks, pages in prefixes:
            if not pages:
                continue
            prefix = self._prefixes.get(prefix_hash)
            if prefix is None:
                prefix = self._know(prefix_hash, blocks, pages)
            elif prefix.requests == 0:
                self._idle.pop(prefix_hash, None)
            prefix.requests += 1
            watched.append(prefix_hash)
        if watched:
            self._by_request[request_id] = tuple(watched)

    def unwatch(self, request_id: str) -> None:
        """The request left the backend: its prefixes stay known while held (bounded)."""
        for prefix_hash in self._by_request.pop(request_id, ()):
            prefix = self._prefixes[prefix_hash]
            prefix.requests -= 1
            if prefix.requests:
                continue
            if prefix.missing:
                self._forget(prefix_hash, prefix)
                continue
            self._idle[prefix_hash] = None
            while len(self._idle) > self._max_idle:
                oldest, _ = self._idle.popitem(last=False)
                self._before.setdefault(oldest, True)
                self._forget(oldest, self._prefixes[oldest])

    # ------------------------------------------------------------ the block manager's watcher

    def registered(self, page_hash: bytes) -> None:
        for prefix_hash in self._needed_by.get(page_hash, ()):
            prefix = self._prefixes[prefix_hash]
            prefix.missing -= 1
            if prefix.missing == 0:
                self._before.setdefault(prefix_hash, False)

    def evicted(self, page_hash: bytes) -> None:
        for prefix_hash in list(self._needed_by.get(page_hash, ())):
            prefix = self._prefixes[prefix_hash]
            if prefix.missing == 0:
                self._before.setdefault(prefix_hash, True)
            prefix.missing += 1
            if prefix.requests == 0:
                self._idle.pop(prefix_hash, None)
                self._forget(prefix_hash, prefix)

    # ------------------------------------------------------------ KV events

    def drain(self) -> tuple[list[tuple[int, int]], list[int]]:
        """``(stored, evicted)`` since the last drain: ``stored`` as ``(prefix_hash, blocks)``."""
        stored: list[tuple[int, int]] = []
        evicted: list[int] = []
        prefixes = self._prefixes
        for prefix_hash, was_held in self._before.items():
            prefix = prefixes.get(prefix_hash)
            if prefix is not None and prefix.missing == 0:
                if not was_held:
                    stored.append((prefix_hash, prefix.blocks))
            elif was_held:
                evicted.append(prefix_hash)
        self._before.clear()
        return stored, evicted

    # ------------------------------------------------------------ inside

    def _know(self, prefix_hash: int, blocks: int, pages: tuple[bytes, ...]) -> _Prefix:
        is_cached = self._is_cached
        missing = sum(1 for page_hash in pages if not is_cached(page_hash))
        prefix = self._prefixes[prefix_hash] = _Prefix(blocks, pages, missing)
        for page_hash in pages:
            self._needed_by.setdefault(page_hash, set()).add(prefix_hash)
        if missing == 0:
            self._before.setdefault(prefix_hash, False)
        return prefix

    def _forget(self, prefix_hash: int, prefix: _Prefix) -> None:
        del self._prefixes[prefix_hash]
        needed_by = self._needed_by
        for page_hash in prefix.pages:
            dependents = needed_by[page_hash]
            dependents.discard(prefix_hash)
            if not dependents:
                del needed_by[page_hash]
