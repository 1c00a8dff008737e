"""Continuous-batching scheduler and paged KV-cache bookkeeping, free of torch.

The KV cache is ``num_blocks`` pages of ``block_size`` token slots. A sequence owns a block
table (the pages holding its tokens in order); token ``i`` lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

Each step, :meth:`Scheduler.schedule` first gives every running sequence room for the token
it feeds next (one decode token each), preempting the most recently admitted sequences when
pages run out; then it admits waiting sequences in arrival order while the batch, the
prefill-token budget and the free pages allow. A preempted sequence goes back to the front of
the queue with no cached tokens: it is recomputed (prefilled with prompt plus generated
tokens) when pages are free again. Nothing here knows about tensors, so every rule is tested
on its own (tests/torch/test_torch_scheduler.py).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """The tokens of one request and where their keys and values live.

    ``num_cached`` tokens have keys and values in the cache; a step feeds the rest
    (``token_ids[num_cached:]``) and samples the token that follows them.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING

    @classmethod
    def from_prompt(cls, request_id: str, prompt: list[int]) -> Sequence:
        return cls(request_id, list(prompt), len(prompt))

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_new(self) -> int:
        """Tokens the next step feeds."""
        return len(self.token_ids) - self.num_cached

    def append(self, token: int) -> None:
        """Record a sampled token: every token fed before it is now cached."""
        self.num_cached = len(self.token_ids)
        self.token_ids.append(token)

    def slot(self, position: int, block_size: int) -> int:
        return self.block_table[position // block_size] * block_size + position % block_size


class BlockAllocator:
    """Hands out cache pages; a page is owned by at most one sequence."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, sequence: Sequence, num_tokens: int) -> bool:
        """Whether ``sequence`` can grow to ``num_tokens`` cached tokens with the pages free now."""
        return self.blocks_for(num_tokens) - len(sequence.block_table) <= self.num_free

    def grow(self, sequence: Sequence, num_tokens: int) -> None:
        """Give ``sequence`` pages for ``num_tokens`` tokens; callers check :meth:`can_hold` first."""
        missing = self.blocks_for(num_tokens) - len(sequence.block_table)
        if missing > self.num_free:
            raise RuntimeError(f"request_id={sequence.request_id}: {missing} pages needed, {self.num_free} free")
        sequence.block_table.extend(self._free.popleft() for _ in range(missing))

    def release(self, sequence: Sequence) -> None:
        self._free.extend(sequence.block_table)
        sequence.block_table = []
        sequence.num_cached = 0


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
    def __init__(self, allocator: BlockAllocator, max_batch: int, max_prefill_tokens: int) -> None:
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_prefill_tokens ({max_prefill_tokens}) must be >= 1")
        self.allocator = allocator
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preempted = 0

    def add(self, sequence: Sequence) -> None:
        if self.allocator.blocks_for(len(sequence.token_ids)) > self.allocator.num_blocks:
            raise ValueError(f"request_id={sequence.request_id}: {len(sequence.token_ids)} tokens never fit the cache")
        sequence.status = SequenceStatus.WAITING
        self.waiting.append(sequence)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, sequence: Sequence) -> None:
        """Finish or abort: the sequence leaves the scheduler and its pages are free at once."""
        if sequence.status is SequenceStatus.RUNNING:
            self.running.remove(sequence)
        elif sequence.status is SequenceStatus.WAITING:
            self.waiting.remove(sequence)
        else:
            return
        sequence.status = SequenceStatus.FINISHED
        self.allocator.release(sequence)

    def preempt_all(self) -> None:
        """Drop every cached token (suspend); running sequences wait to be recomputed, in order."""
        while self.running:
            self._preempt(self.running.pop())

    def schedule(self) -> ScheduledBatch:
        decode = self._schedule_decode()
        return ScheduledBatch(decode, self._admit())

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        index = 0
        while index < len(self.running):
            sequence = self.running[index]
            needed = len(sequence.token_ids)
            while not self.allocator.can_hold(sequence, needed) and self.running[-1] is not sequence:
                self._preempt(self.running.pop())
            if not self.allocator.can_hold(sequence, needed):
                self._preempt(self.running.pop())
                break
            self.allocator.grow(sequence, needed)
            scheduled.append(sequence)
            index += 1
        return scheduled

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_batch:
            sequence = self.waiting[0]
            needed = len(sequence.token_ids)
            if admitted and sequence.num_new > budget:
                break
            if not self.allocator.can_hold(sequence, needed):
                break
            self.waiting.popleft()
            self.allocator.grow(sequence, needed)
            sequence.status = SequenceStatus.RUNNING
            self.running.append(sequence)
            admitted.append(sequence)
            budget -= sequence.num_new
        return admitted

    def _preempt(self, sequence: Sequence) -> None:
        self.allocator.release(sequence)
        sequence.status = SequenceStatus.WAITING
        self.waiting.appendleft(sequence)
        self.num_preempted += 1
