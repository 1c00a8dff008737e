"""The continuous-batching scheduler and KV-cache page bookkeeping, tested without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.torch_backend.block_manager import BlockManager
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import Sequence, SequenceStatus
from tests.torch.reference import record_token


def make(
    num_blocks: int = 8,
    block_size: int = 4,
    max_batch: int = 4,
    max_prefill_tokens: int = 64,
    prefix_caching: bool = False,
) -> Scheduler:
    """Prefix caching off unless asked: these sequences share their leading tokens."""
    return Scheduler(BlockManager(num_blocks, block_size, prefix_caching), max_batch, max_prefill_tokens)


def seq(rid: str, length: int) -> Sequence:
    return Sequence.from_prompt(rid, list(range(length)))


def advance(batch_sequences: list[Sequence]) -> None:
    for sequence in batch_sequences:
        record_token(sequence, 0)


def test_the_module_does_not_import_torch() -> None:
    code = "import sys, engines.torch_backend.scheduler; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_new_requests_are_prefilled_then_decoded_together() -> None:
    scheduler = make()
    a, b = seq("a", 5), seq("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert first.decode == [] and first.prefill == [a, b]
    assert (a.num_new, b.num_new) == (5, 3)
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    advance(first.sequences)
    c = seq("c", 2)
    scheduler.add(c)
    second = scheduler.schedule()
    assert second.decode == [a, b] and second.prefill == [c]
    assert a.num_new == 1 and a.num_cached == 5


def test_slots_follow_the_block_table() -> None:
    scheduler = make(block_size=4)
    scheduler.add(first := seq("first", 3))
    scheduler.add(second := seq("second", 6))
    scheduler.schedule()
    slots = [second.slot(position, 4) for position in range(6)]
    assert len(set(slots)) == 6
    assert not set(slots) & {first.slot(position, 4) for position in range(3)}
    assert slots[:4] == [second.block_table[0] * 4 + i for i in range(4)]


def test_max_batch_limits_running_and_the_rest_queue_in_order() -> None:
    scheduler = make(num_blocks=32, max_batch=2)
    sequences = [seq(str(i), 2) for i in range(4)]
    for sequence in sequences:
        scheduler.add(sequence)
    assert scheduler.schedule().prefill == sequences[:2]
    assert list(scheduler.waiting) == sequences[2:]
    scheduler.remove(sequences[0])
    batch = scheduler.schedule()
    assert batch.decode == [sequences[1]] and batch.prefill == [sequences[2]]


def test_prefill_token_budget_splits_admissions_but_a_long_prompt_still_runs() -> None:
    scheduler = make(num_blocks=64, max_prefill_tokens=10)
    long, short1, short2 = seq("long", 30), seq("s1", 6), seq("s2", 6)
    for sequence in (long, short1, short2):
        scheduler.add(sequence)
    assert scheduler.schedule().prefill == [long]  # over budget, but alone
    advance([long])
    assert scheduler.schedule().prefill == [short1]  # 6 + 6 > 10
    advance([long, short1])
    assert scheduler.schedule().prefill == [short2]


def test_requests_wait_when_the_cache_is_full() -> None:
    scheduler = make(num_blocks=4, block_size=4)
    a, b = seq("a", 12), seq("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.schedule().prefill == [a]  # b needs 2 pages, 1 is free
    assert list(scheduler.waiting) == [b] and b.block_table == []
    scheduler.remove(a)  # finishing frees the pages at once
    assert scheduler.blocks.num_free == 4
    assert scheduler.schedule().prefill == [b]


def test_decode_preempts_the_latest_request_when_pages_run_out() -> None:
    scheduler = make(num_blocks=3, block_size=4)
    a, b = seq("a", 4), seq("b", 4)
    for sequence in (a, b):
        scheduler.add(sequence)
    advance(scheduler.schedule().sequences)  # 2 pages used; both now need a second page
    batch = scheduler.schedule()
    assert batch.decode == [a] and batch.prefill == []
    assert b.status is SequenceStatus.WAITING and b.num_cached == 0 and b.block_table == []
    assert list(scheduler.waiting) == [b] and scheduler.num_preempted == 1
    advance(batch.sequences)
    scheduler.remove(a)
    resumed = scheduler.schedule()
    assert resumed.prefill == [b] and b.num_new == 5  # recompute: prompt and generated token


def test_preempt_all_keeps_order_and_frees_every_page() -> None:
    scheduler = make(num_blocks=16)
    sequences = [seq(str(i), 3) for i in range(3)]
    for sequence in sequences:
        scheduler.add(sequence)
    advance(scheduler.schedule().sequences)
    scheduler.add(late := seq("late", 2))
    scheduler.preempt_all()
    assert scheduler.blocks.num_free == 16 and scheduler.running == []
    assert list(scheduler.waiting) == [*sequences, late]
    assert all(sequence.num_new == 4 for sequence in sequences)


def test_abort_of_waiting_and_running_requests() -> None:
    scheduler = make(num_blocks=8, max_batch=1)
    running, waiting = seq("r", 5), seq("w", 5)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    scheduler.remove(waiting)
    scheduler.remove(running)
    scheduler.remove(running)  # twice is harmless
    assert not scheduler.has_work() and scheduler.blocks.num_free == 8
    assert running.status is SequenceStatus.FINISHED


def test_a_held_sequence_gives_its_pages_back_and_is_recomputed_first_when_released() -> None:
    scheduler = make(num_blocks=8, max_batch=2)
    held, other, queued = seq("h", 5), seq("o", 3), seq("q", 2)
    for sequence in (held, other, queued):
        scheduler.add(sequence)
    advance(scheduler.schedule().sequences)  # h and o run, q waits (max_batch)
    assert scheduler.hold(held) and not scheduler.hold(held)  # held once
    assert held.status is SequenceStatus.HELD and held.block_table == []
    assert scheduler.hold(queued) and list(scheduler.waiting) == []  # a waiting one leaves the queue
    batch = scheduler.schedule()
    assert batch.decode == [other] and batch.prefill == []  # neither held one is scheduled
    advance(batch.sequences)
    scheduler.remove(other)
    assert not scheduler.has_work()  # what is held is no work
    scheduler.release(queued)
    scheduler.release(held)
    scheduler.release(held)  # twice is harmless
    resumed = scheduler.schedule()
    assert resumed.prefill == [held, queued] and held.num_new == 6  # recomputed: prompt and generated token
    scheduler.hold(queued)
    scheduler.remove(queued)  # an abort while held
    assert queued.status is SequenceStatus.FINISHED and scheduler.held == []


def test_a_prompt_larger_than_the_whole_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="never fit"):
        make(num_blocks=2, block_size=4).add(seq("big", 9))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=10),
    steps=st.lists(st.sampled_from(["step", "finish", "abort"]), max_size=40),
)
def test_pages_are_never_shared_or_lost(lengths: list[int], steps: list[str]) -> None:
    scheduler = make(num_blocks=10, block_size=3, max_batch=3, max_prefill_tokens=20)
    sequences = [seq(str(i), n) for i, n in enumerate(lengths)]
    for sequence in sequences:
        scheduler.add(sequence)
    for action in steps:
        if action == "step":
            batch = scheduler.schedule()
            for sequence in batch.sequences:
                assert len(sequence.block_table) * 3 >= len(sequence.token_ids)
            advance(batch.sequences)
        elif scheduler.running:
            scheduler.remove(scheduler.running[0] if action == "finish" else scheduler.running[-1])
        owned = [block for sequence in scheduler.running for block in sequence.block_table]
        assert len(owned) == len(set(owned))
        assert len(owned) + scheduler.blocks.num_free == 10
        assert all(sequence.block_table == [] for sequence in scheduler.waiting)
