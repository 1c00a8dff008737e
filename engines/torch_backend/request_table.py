"""The torch backend's requests: the one owner of its request table and of the scheduler that
batches their sequences, both under one lock.

Two threads touch them: the event loop adds and aborts requests (:meth:`RequestTable.add`,
:meth:`RequestTable.abort`) while the step thread schedules, writes sampled tokens into the
sequences and finishes requests (:mod:`engines.torch_backend.step_phases`). A step's launch
and collect are compound (schedule, read every row's tokens and pages, leave placeholders;
write tokens back, commit pages, finish), so they hold :attr:`RequestTable.lock` across them
and call the transitions marked "under the lock" and the scheduler's own methods (it owns the
batching state, its block manager the pages). Nothing else writes the table.

With prefix caching on, it also keeps which of its requests' prompt prefixes the cache holds
(:mod:`engines.torch_backend.held_prefixes`, told by the block manager what enters and leaves
the cache): each request's prefixes are known from ``add`` until it leaves, and
:meth:`RequestTable.cache_changes` drains what changed, for the runtime's KV events.
"""

from __future__ import annotations

import threading

from engines.backend import CacheChanges
from engines.torch_backend.held_prefixes import HeldPrefixes
from engines.torch_backend.logprobs import RowsAsking
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import Sequence, SequenceStatus
from engines.torch_backend.step_records import StepRows
from service.protocol.errors import ErrorCode, WireError

# Held prefixes no request has that are remembered, per page of the cache.
IDLE_PREFIXES_PER_PAGE = 4


class RequestTable:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.lock = threading.Lock()  # the table, the scheduler and every sequence's tokens and pages
        self._requests: dict[str, RequestState] = {}
        self._rows = StepRows()
        blocks = scheduler.blocks
        self.held: HeldPrefixes | None = None
        if blocks.prefix_caching:
            self.held = blocks.watcher = HeldPrefixes(blocks.is_cached, IDLE_PREFIXES_PER_PAGE * blocks.num_blocks)

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, state: RequestState) -> None:
        """Queue a request; a request id already running is a conflict, a sequence that could
        never fit the cache a ``ValueError`` (``Scheduler.add``)."""
        request_id = state.request.request_id
        with self.lock:
            if request_id in self._requests:
                raise WireError(ErrorCode.CONFLICT, f"request {request_id} is already running")
            self.scheduler.add(state.sequence)
            self._requests[request_id] = state
            if self.held is not None and state.request.prefixes:
                self.held.watch(request_id, self._prefix_pages(state))

    def resumed_text(self, request_id: str) -> str:
        with self.lock:
            return self._requests[request_id].resumed_text

    def abort(self, request_id: str) -> bool:
        """The request leaves the table and the scheduler (its pages are free); False when it
        is not here (finished or never added)."""
        with self.lock:
            state = self._requests.pop(request_id, None)
            if state is None:
                return False
            self.scheduler.remove(state.sequence)
            if self.held is not None:
                self.held.unwatch(request_id)
            return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def hold(self, request_id: str) -> bool:
        """Backpressure: the request is not scheduled until :meth:`release` (``Scheduler.hold``)."""
        with self.lock:
            state = self._requests.get(request_id)
            return state is not None and self.scheduler.hold(state.sequence)

    def release(self, request_id: str) -> None:
        with self.lock:
            state = self._requests.get(request_id)
            if state is not None:
                self.scheduler.release(state.sequence)

    def states(self, sequences: list[Sequence]) -> tuple[list[RequestState], bool]:
        """Under the lock: the requests of a step's rows, and whether every one samples greedily."""
        rows = self._rows
        return rows.states(sequences, self._requests), rows.greedy

    @property
    def asking(self) -> RowsAsking | None:
        """Under the lock: the rows of the last :meth:`states` that asked for logprobs."""
        return self._rows.asking

    def finish(self, state: RequestState) -> None:
        """Under the lock: the request leaves the scheduler (its pages are free) and the table;
        a request already finished or aborted stays so."""
        if state.sequence.status is SequenceStatus.FINISHED:
            return
        self.scheduler.remove(state.sequence)
        request_id = state.request.request_id
        del self._requests[request_id]
        if self.held is not None:
            self.held.unwatch(request_id)

    def drop_cache(self) -> None:
        """The cache's contents are gone or stale (suspend, new weights): every running sequence
        waits to be recomputed and every prefix is forgotten."""
        with self.lock:
            self.scheduler.drop_cache()

    def clear(self) -> None:
        """Close: every request leaves the scheduler and the table, and every prefix is forgotten."""
        with self.lock:
            for request_id, state in self._requests.items():
                self.scheduler.remove(state.sequence)
                if self.held is not None:
                    self.held.unwatch(request_id)
            self._requests.clear()
            self.scheduler.drop_cache()

    def cache_changes(self) -> CacheChanges:
        """The prefixes the cache began and stopped holding since the last call, and the
        tokens the waiting requests will prefill; only with prefix caching on."""
        if self.held is None:
            raise RuntimeError("without prefix caching no prefix is held")
        with self.lock:
            stored, evicted = self.held.drain()
            return CacheChanges(stored, evicted, self.scheduler.queued_tokens())

    def _prefix_pages(self, state: RequestState) -> list[tuple[int, int, tuple[bytes, ...]]]:
        """Under the lock: each prefix of the request's prompt with the hashes of the full
        pages it covers (a text or chat prompt's: all of the prompt's)."""
        sequence = state.sequence
        prompt = sequence.num_prompt_tokens
        page = self.scheduler.blocks.block_size
        counts = [
            min(prompt if prefix.tokens is None else prefix.tokens, prompt) // page for prefix in state.request.prefixes
        ]
        self.scheduler.blocks.hash_pages(sequence, max(counts))
        hashes = sequence.page_hashes
        return [
            (prefix.prefix_hash, prefix.blocks, tuple(hashes[:count]))
            for prefix, count in zip(state.request.prefixes, counts, strict=True)
        ]
