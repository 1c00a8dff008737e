"""Prefix caching in the KV-cache page bookkeeping, without torch: chained page hashes,
reference counts, reuse of a cached prefix, least-recently-released eviction, suspend, and a
property test that every reused page holds exactly the tokens its readers expect."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.torch_backend.block_manager import BlockManager, chain_hash
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import Sequence, SequenceStatus
from tests.torch.reference import record_token


def make(num_blocks: int = 16, block_size: int = 4, max_batch: int = 8, max_prefill_tokens: int = 256) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_batch, max_prefill_tokens)


def run_to_end(scheduler: Scheduler, *sequences: Sequence, generate: int = 1) -> None:
    """Add the sequences, then step (appending token 0) until each generated ``generate`` tokens and finish them."""
    for sequence in sequences:
        scheduler.add(sequence)
    while any(sequence.status is not SequenceStatus.FINISHED for sequence in sequences):
        for sequence in scheduler.schedule().sequences:
            record_token(sequence, 0, scheduler.blocks)
            if sequence.num_generated >= generate:
                scheduler.remove(sequence)


def test_a_page_hash_covers_the_whole_prefix() -> None:
    first, second = chain_hash(b"", [1, 2, 3, 4]), chain_hash(b"", [5, 6, 7, 8])
    assert chain_hash(first, [5, 6, 7, 8]) != second  # the same page after another prefix
    assert chain_hash(first, [5, 6, 7, 8]) == chain_hash(chain_hash(b"", [1, 2, 3, 4]), [5, 6, 7, 8])
    assert chain_hash(b"", [1, 2, 3, 4]) != chain_hash(b"", [1, 2, 3, 5])


def test_a_second_request_reuses_the_full_pages_of_the_first() -> None:
    scheduler = make()
    prompt = list(range(10, 20))  # 10 tokens: pages [10..13] [14..17] and 2 tokens in a third
    first = Sequence.from_prompt("first", prompt)
    run_to_end(scheduler, first)
    blocks = scheduler.blocks
    assert blocks.stats().cached_pages == 2 and blocks.num_free == 16
    second = Sequence.from_prompt("second", [*prompt, 99])
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.prefill == [second]
    assert second.num_cached == 8 and second.num_new == 3  # two pages reused, three tokens fed
    stats = blocks.stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (10 + 11, 8)
    assert 0.38 < stats.hit_rate < 0.39


def test_a_prompt_read_whole_from_the_cache_feeds_its_last_token_alone() -> None:
    scheduler = make()
    prompt = list(range(8))  # exactly two pages
    first = Sequence.from_prompt("a", prompt)
    run_to_end(scheduler, first)
    again = Sequence.from_prompt("b", prompt)
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached == 7 and again.num_new == 1  # its logits give the next token
    assert again.num_committed == 2  # both pages shared: the fed token's keys go to the scratch page
    stats = scheduler.blocks.stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (16, 7)


def test_prompts_that_diverge_share_the_pages_before_the_divergence() -> None:
    scheduler = make()
    run_to_end(scheduler, Sequence.from_prompt("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = Sequence.from_prompt("b", [1, 2, 3, 4, 5, 6, 0, 8, 9])
    scheduler.add(other)
    scheduler.schedule()
    assert other.num_cached == 4


def test_shared_pages_are_counted_and_outlive_each_user() -> None:
    scheduler = make()
    prompt = list(range(9))
    run_to_end(scheduler, Sequence.from_prompt("warm", prompt))
    a, b = Sequence.from_prompt("a", prompt), Sequence.from_prompt("b", prompt)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    blocks = scheduler.blocks
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and a.block_table[2] != b.block_table[2]
    assert [blocks.refs(page) for page in shared] == [2, 2]
    scheduler.remove(a)  # abort: the shared pages stay with b
    assert [blocks.refs(page) for page in shared] == [1, 1]
    scheduler.remove(b)
    assert [blocks.refs(page) for page in shared] == [0, 0] and blocks.num_free == 16
    c = Sequence.from_prompt("c", prompt)
    scheduler.add(c)
    scheduler.schedule()
    assert c.block_table[:2] == shared


def test_unreferenced_cached_pages_are_evicted_least_recently_released_first() -> None:
    scheduler = make(num_blocks=6, block_size=2)
    old, recent = [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]  # two full pages each, plus a token
    run_to_end(scheduler, Sequence.from_prompt("old", old))
    run_to_end(scheduler, Sequence.from_prompt("recent", recent))
    blocks = scheduler.blocks
    assert blocks.stats().cached_pages == 4  # both prompts' full pages; both tails went back blank
    # Pages are blank first: 2 blank pages, then 2 of the old prompt's cached ones are evicted.
    big = Sequence.from_prompt("big", [3] * 8)
    scheduler.add(big)
    scheduler.schedule()
    assert blocks.stats().evicted_pages == 2 and blocks.stats().cached_pages == 2
    scheduler.remove(big)
    again_recent = Sequence.from_prompt("again-recent", recent)
    again_old = Sequence.from_prompt("again-old", old)
    for sequence in (again_recent, again_old):
        scheduler.add(sequence)
    scheduler.schedule()
    assert again_recent.num_cached == 4 and again_old.num_cached == 0


def test_a_cached_hit_needs_no_free_page_but_leaves_the_free_pool() -> None:
    scheduler = make(num_blocks=3, block_size=2)
    prompt = [7, 7, 7, 7, 7]  # two full pages and one token: the whole cache
    run_to_end(scheduler, Sequence.from_prompt("a", prompt))
    blocks = scheduler.blocks
    assert blocks.num_free == 3 and blocks.stats().cached_pages == 2
    again = Sequence.from_prompt("b", prompt)
    scheduler.add(again)
    assert scheduler.schedule().prefill == [again] and again.num_cached == 4
    assert blocks.num_free == 0 and blocks.stats().evicted_pages == 0


def test_a_preempted_request_resumes_from_its_own_cached_pages() -> None:
    scheduler = make(num_blocks=5, block_size=2)
    a, b = Sequence.from_prompt("a", [1, 2, 3, 4, 5]), Sequence.from_prompt("b", [6, 7, 8, 9])
    for sequence in (a, b):
        scheduler.add(sequence)
    for sequence in scheduler.schedule().sequences:  # a: 3 pages, b: 2 pages
        record_token(sequence, 0, scheduler.blocks)
    batch = scheduler.schedule()  # b needs a third page, none is free: b is preempted
    assert batch.decode == [a] and b.status is SequenceStatus.WAITING
    record_token(a, 0, scheduler.blocks)
    scheduler.remove(a)
    resumed = scheduler.schedule()
    assert resumed.prefill == [b] and b.num_cached == 4 and b.num_new == 1  # prompt pages cached, the sampled token fed


def test_dropping_the_cache_forgets_every_prefix() -> None:
    scheduler = make()
    prompt = list(range(9))
    running = Sequence.from_prompt("running", prompt)
    run_to_end(scheduler, Sequence.from_prompt("done", prompt))
    scheduler.add(running)
    scheduler.schedule()
    scheduler.drop_cache()
    blocks = scheduler.blocks
    assert blocks.stats().cached_pages == 0 and blocks.num_free == 16
    assert running.status is SequenceStatus.WAITING and running.num_cached == 0
    scheduler.schedule()
    assert running.num_cached == 0  # recomputed from scratch: the cache's contents are gone


def test_identical_prompts_admitted_together_do_not_share_and_one_copy_is_kept() -> None:
    scheduler = make()
    a, b = Sequence.from_prompt("a", list(range(9))), Sequence.from_prompt("b", list(range(9)))
    run_to_end(scheduler, a, b)
    assert scheduler.blocks.stats().cached_pages == 2 and scheduler.blocks.num_free == 16


def test_off_means_no_reuse_and_no_hashes() -> None:
    scheduler = Scheduler(BlockManager(16, 4, prefix_caching=False), 8, 256)
    run_to_end(scheduler, Sequence.from_prompt("a", list(range(9))))
    again = Sequence.from_prompt("b", list(range(9)))
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached == 0 and again.page_hashes == []
    assert scheduler.blocks.stats().cached_pages == 0


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=9), min_size=1, max_size=8),
    actions=st.lists(st.sampled_from(["step", "step", "finish", "abort", "add", "drop"]), max_size=50),
)
def test_reused_pages_always_hold_the_tokens_their_readers_expect(prompts: list[list[int]], actions: list[str]) -> None:
    """A model of the cache's contents: each step writes every fed token into its slot. Every
    token a running sequence counts as cached must be in its slot; references must match owners."""
    num_blocks, block_size = 10, 2
    scheduler = Scheduler(BlockManager(num_blocks, block_size), max_batch=3, max_prefill_tokens=12)
    contents: dict[int, int] = {}  # slot -> token written there
    pending = [Sequence.from_prompt(str(i), prompt) for i, prompt in enumerate(prompts)]
    scheduler.add(pending.pop())
    for action in actions:
        if action == "step":
            batch = scheduler.schedule()
            for sequence in batch.sequences:
                assert sequence.num_cached % block_size == 0 or sequence in batch.decode or sequence.num_new == 1
                shared = sequence.num_committed * block_size  # a fed token there goes to the scratch page
                for position in range(max(sequence.num_cached, shared)):
                    assert contents.get(sequence.slot(position, block_size)) == sequence.token_ids[position]
                for position in range(max(sequence.num_cached, shared), len(sequence.token_ids)):
                    contents[sequence.slot(position, block_size)] = sequence.token_ids[position]
                record_token(sequence, len(sequence.token_ids) % 3, scheduler.blocks)
        elif action == "add" and pending:
            scheduler.add(pending.pop())
        elif action == "drop":
            scheduler.drop_cache()
            contents.clear()
        elif scheduler.running:
            scheduler.remove(scheduler.running[0] if action == "finish" else scheduler.running[-1])
        blocks = scheduler.blocks
        owners: dict[int, int] = {}
        for sequence in scheduler.running:
            assert len(set(sequence.block_table)) == len(sequence.block_table)
            for page in sequence.block_table:
                owners[page] = owners.get(page, 0) + 1
        assert all(blocks.refs(page) == owners.get(page, 0) for page in range(num_blocks))
        assert len(owners) + blocks.num_free == num_blocks
        assert all(sequence.block_table == [] for sequence in scheduler.waiting)
