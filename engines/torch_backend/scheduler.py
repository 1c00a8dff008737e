"""Continuous-batching scheduler, free of torch.

Each step, :meth:`Scheduler.schedule` first gives every running sequence room for the token
it feeds next (one decode token each), preempting the most recently admitted sequences when
pages run out; then it admits waiting sequences in arrival order while the batch, the
prefill-token budget and the free pages allow. An admitted sequence starts after the prefix
the block manager (:mod:`engines.torch_backend.block_manager`) found cached, so the budget
counts only the tokens it still feeds. A preempted sequence goes back to the front of the
queue with no pages: it is recomputed (prompt plus generated tokens, less whatever prefix is
still cached) when pages are free again. A sequence held back by backpressure (:meth:`Scheduler.hold`)
gives its pages back the same way and is not scheduled until released, when it waits first in
line to be recomputed. Siblings are prefilled once: a waiting sequence whose next uncached page
another sequence is computing (admitted in this schedule, or in the one before, whose step may
still be in flight) is deferred in its place, so the next schedule serves that page from the
cache instead of computing it again (SGLang's in-batch prefix check). Nothing here knows about
tensors, so every rule is
tested on its own (tests/torch/test_torch_scheduler.py, tests/torch/test_torch_prefix_cache.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engines.torch_backend.block_manager import BlockManager
from engines.torch_backend.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: decode sequences (one new token each) first, then prefills."""

    decode: list[Sequence]
    prefill: list[Sequence]

    @property
    def sequences(self) -> list[Sequence]:
        return self.decode + self.prefill

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_prefill_tokens: int) -> None:
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_prefill_tokens ({max_prefill_tokens}) must be >= 1")
        self.blocks = blocks
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # held back by backpressure: no pages, not scheduled
        self.num_preempted = 0
        self.grown: list[Sequence] = []  # sequences the last schedule gave a new page
        self._computing: set[bytes] = set()  # hashes of the pages the last schedule's prefills compute
        self.num_deferred = 0  # admissions deferred for a page another sequence was computing

    def add(self, sequence: Sequence) -> None:
        if self.blocks.blocks_for(len(sequence.token_ids)) > self.blocks.num_blocks:
            raise ValueError(f"request_id={sequence.request_id}: {len(sequence.token_ids)} tokens never fit the cache")
        sequence.status = SequenceStatus.WAITING
        self.waiting.append(sequence)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_tokens(self) -> int:
        """Tokens the waiting sequences will feed once admitted, less the prefix cached now."""
        blocks = self.blocks
        return sum(
            len(sequence.token_ids) - blocks.cached_length(sequence, blocks.match(sequence))
            for sequence in self.waiting
        )

    def remove(self, sequence: Sequence) -> None:
        """Finish or abort: the sequence leaves the scheduler and its pages are free at once."""
        if sequence.status is SequenceStatus.RUNNING:
            self.running.remove(sequence)
        elif sequence.status is SequenceStatus.WAITING:
            self.waiting.remove(sequence)
        elif sequence.status is SequenceStatus.HELD:
            self.held.remove(sequence)
        else:
            return
        sequence.status = SequenceStatus.FINISHED
        self.blocks.release(sequence)

    def hold(self, sequence: Sequence) -> bool:
        """Backpressure: leave ``sequence`` out of the steps until :meth:`release`. A running
        one gives its pages back as a preempted one does (it is recomputed when released, less
        what of its prefix is still cached), a waiting one leaves the queue; False for one
        finished or held already."""
        if sequence.status is SequenceStatus.RUNNING:
            self.running.remove(sequence)
            self._give_back(sequence)
        elif sequence.status is SequenceStatus.WAITING:
            self.waiting.remove(sequence)
        else:
            return False
        sequence.status = SequenceStatus.HELD
        self.held.append(sequence)
        return True

    def release(self, sequence: Sequence) -> None:
        """A held sequence waits again, first in line, as a preempted one does."""
        if sequence.status is SequenceStatus.HELD:
            self.held.remove(sequence)
            sequence.status = SequenceStatus.WAITING
            self.waiting.appendleft(sequence)

    def preempt_all(self) -> None:
        """Running sequences give their pages back and wait to be recomputed, in order."""
        while self.running:
            self._preempt(self.running.pop())

    def drop_cache(self) -> None:
        """The cache's contents are gone (suspend): preempt everything and forget every prefix."""
        self.preempt_all()
        self.blocks.clear()

    def schedule(self) -> ScheduledBatch:
        decode = self._schedule_decode()
        return ScheduledBatch(decode, self._admit())

    def _schedule_decode(self) -> list[Sequence]:
        """Every running sequence, in order, with room for the token it feeds; the ones that
        needed a new page for it are in :attr:`grown` (a decode step's block tables change
        only there). A sequence whose pending token reaches its ``limit`` is left out: that
        token ends it."""
        scheduled: list[Sequence] = []
        self.grown = []
        running, blocks, page = self.running, self.blocks, self.blocks.block_size
        index = 0
        while index < len(running):
            sequence = running[index]
            needed = len(sequence.token_ids)
            if needed >= sequence.limit:
                index += 1
                continue
            if needed > len(sequence.block_table) * page:  # most steps: the last page has room
                while not blocks.can_hold(sequence, needed) and running[-1] is not sequence:
                    self._preempt(running.pop())
                if not blocks.can_hold(sequence, needed):
                    self._preempt(running.pop())
                    break
                blocks.grow(sequence, needed)
                self.grown.append(sequence)
            scheduled.append(sequence)
            index += 1
        return scheduled

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        deferred: list[Sequence] = []
        budget = self.max_prefill_tokens
        waiting, blocks = self.waiting, self.blocks
        earlier, computing = self._computing, set()
        while waiting and len(self.running) < self.max_batch:
            sequence = waiting[0]
            hits = blocks.match(sequence)
            hashes = sequence.page_hashes
            # Deferred only for a page it could read from the cache (none for a sequence that
            # wants its prompt's logits).
            if len(hits) < blocks.reusable(sequence) and (
                hashes[len(hits)] in computing or hashes[len(hits)] in earlier
            ):
                deferred.append(waiting.popleft())  # that page is being computed: read it next step
                continue
            if admitted and len(sequence.token_ids) - blocks.cached_length(sequence, hits) > budget:
                break
            if not blocks.can_admit(sequence, hits):
                break
            waiting.popleft()
            blocks.admit(sequence, hits)
            sequence.status = SequenceStatus.RUNNING
            self.running.append(sequence)
            admitted.append(sequence)
            budget -= sequence.num_new
            computing.update(hashes[len(hits) :])
        if deferred:
            waiting.extendleft(reversed(deferred))
            self.num_deferred += len(deferred)
        self._computing = computing
        return admitted

    def _preempt(self, sequence: Sequence) -> None:
        self._give_back(sequence)
        sequence.status = SequenceStatus.WAITING
        self.waiting.appendleft(sequence)

    def _give_back(self, sequence: Sequence) -> None:
        """A running sequence's pages go back; a step in flight drops its token for it."""
        self.blocks.release(sequence)
        sequence.drop_placeholder()  # its token is sampled again when it is recomputed
        self.num_preempted += 1
        sequence.preempted = self.num_preempted
