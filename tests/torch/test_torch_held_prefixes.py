"""Which prompt prefixes the torch backend's prefix cache holds, for KV events
(engines/torch_backend/held_prefixes.py): told by the block manager what enters and leaves the
cache, checked here on the scheduler and pages without a model, then through the backend."""

from __future__ import annotations

import pytest

from engines.backend import GenerationRequest, PromptPrefix
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.block_manager import BlockManager
from engines.torch_backend.held_prefixes import HeldPrefixes
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import Sequence, SequenceStatus
from service.protocol.prefix import TOKENS_PER_BLOCK, prompt_prefixes
from tests.torch.reference import engine_options, record_token, run_to_end

PAGE = 16


class Engine:
    """A scheduler and its pages with a :class:`HeldPrefixes` watching them, as the request table
    wires them; requests generate one token (0) per step."""

    def __init__(self, num_blocks: int = 32, max_idle: int = 100) -> None:
        self.scheduler = Scheduler(BlockManager(num_blocks, PAGE), max_batch=8, max_prefill_tokens=4096)
        blocks = self.scheduler.blocks
        self.held = blocks.watcher = HeldPrefixes(blocks.is_cached, max_idle)

    def add(self, request_id: str, prompt: list[int]) -> Sequence:
        sequence = Sequence.from_prompt(request_id, prompt)
        self.scheduler.add(sequence)
        prefixes = [
            (prefix_hash, blocks, _pages(self.scheduler.blocks, sequence, blocks * TOKENS_PER_BLOCK // PAGE))
            for prefix_hash, blocks in prompt_prefixes(prompt)
        ]
        self.held.watch(request_id, prefixes)
        return sequence

    def step(self) -> list[Sequence]:
        scheduled = self.scheduler.schedule().sequences
        for sequence in scheduled:
            record_token(sequence, 0, self.scheduler.blocks)
        return scheduled

    def finish(self, sequence: Sequence) -> None:
        self.scheduler.remove(sequence)
        self.held.unwatch(sequence.request_id)


def _pages(blocks: BlockManager, sequence: Sequence, count: int) -> tuple[bytes, ...]:
    blocks.hash_pages(sequence, count)
    return tuple(sequence.page_hashes[:count])


def stored_of(prompt: list[int]) -> list[tuple[int, int]]:
    return prompt_prefixes(prompt)


def test_a_prompts_prefixes_are_stored_when_its_prefill_fills_their_pages_not_at_admission() -> None:
    engine = Engine()
    prompt = list(range(64))  # prefixes of 1, 2 and 4 blocks: pages 1, 2 and 4
    engine.add("a", prompt)
    assert engine.held.drain() == ([], [])
    engine.scheduler.schedule()  # admitted: nothing is computed yet
    assert engine.held.drain() == ([], [])
    [sequence] = engine.scheduler.running
    record_token(sequence, 0, engine.scheduler.blocks)  # the prefill's pages are written
    assert sorted(engine.held.drain()[0]) == sorted(stored_of(prompt))
    engine.finish(sequence)  # its pages stay cached, and its prefixes held
    assert engine.held.drain() == ([], []) and all(engine.held.held(h) for h, _ in stored_of(prompt))


def test_a_prefix_leaves_as_soon_as_any_of_its_pages_does() -> None:
    engine = Engine(num_blocks=4)
    first = engine.add("a", list(range(64)))
    engine.step()
    engine.finish(first)
    engine.held.drain()
    other = engine.add("b", list(range(1000, 1032)) + [1])  # 3 pages: the 3 least recently released
    engine.step()
    stored, evicted = engine.held.drain()
    hashes = [prefix_hash for prefix_hash, _ in stored_of(list(range(64)))]
    assert sorted(evicted) == sorted(hashes[1:]) and engine.held.held(hashes[0])  # the first page is last in line
    assert sorted(stored) == sorted(stored_of(list(range(1000, 1032))))
    engine.finish(other)
    assert len(engine.held) == 3


def test_a_prefix_shorter_than_a_page_is_never_held() -> None:
    scheduler = Scheduler(BlockManager(16, 32), max_batch=4, max_prefill_tokens=1024)
    blocks = scheduler.blocks
    held = blocks.watcher = HeldPrefixes(blocks.is_cached, 10)
    sequence = Sequence.from_prompt("a", list(range(48)))
    scheduler.add(sequence)
    (one, _), (two, _), (three, _) = prompt_prefixes(list(range(48)))  # 16, 32 and 48 tokens
    held.watch("a", [(one, 1, ()), (two, 2, _pages(blocks, sequence, 1)), (three, 3, _pages(blocks, sequence, 1))])
    scheduler.schedule()
    record_token(sequence, 0, blocks)
    assert sorted(held.drain()[0]) == sorted([(two, 2), (three, 3)])  # 48 tokens: one full page of 32


def test_held_prefixes_no_request_has_are_bounded_and_forgotten_as_evicted() -> None:
    engine = Engine(max_idle=2)
    sequence = engine.add("a", list(range(64)))
    engine.step()
    engine.held.drain()
    engine.finish(sequence)
    stored, evicted = engine.held.drain()
    assert stored == [] and evicted == [stored_of(list(range(64)))[0][0]] and len(engine.held) == 2


def test_a_prefix_that_came_and_went_between_drains_is_not_reported_and_clear_evicts_all() -> None:
    engine = Engine(num_blocks=3)
    first = engine.add("a", list(range(32)) + [5])
    engine.step()
    engine.finish(first)
    second = engine.add("b", list(range(100, 132)) + [5])  # evicts both pages of the first
    engine.step()
    stored, evicted = engine.held.drain()
    assert sorted(stored) == sorted(stored_of(list(range(100, 132)))) and evicted == []
    engine.finish(second)
    engine.scheduler.drop_cache()
    assert sorted(engine.held.drain()[1]) == sorted(h for h, _ in stored_of(list(range(100, 132))))
    assert len(engine.held) == 0


def test_the_backend_reports_prefixes_and_the_tokens_waiting_for_their_prefill() -> None:
    backend = TorchBackend(engine_options(max_batch=1))
    prompt = [(7 * k + 3) % 256 for k in range(70)]  # blocks 1, 2, 4 and the 4th is the last whole one
    prefixes = tuple(PromptPrefix(h, b, b * TOKENS_PER_BLOCK) for h, b in prompt_prefixes(prompt))
    assert backend.publishes_kv_events
    backend.add(GenerationRequest("a", prompt, max_tokens=2, temperature=0.0, prefixes=prefixes))
    backend.add(GenerationRequest("b", prompt, max_tokens=2, temperature=0.0, prefixes=prefixes))
    assert backend.cache_changes().queued_tokens == 140
    backend._step()  # a prefills; b waits for the batch, its first 4 pages cached now
    changes = backend.cache_changes()
    assert sorted(changes.stored) == sorted(prompt_prefixes(prompt)) and changes.queued_tokens == 70 - 64
    run_to_end(backend)
    assert backend.cache_changes().queued_tokens == 0
    assert not TorchBackend(engine_options(prefix_caching=False)).publishes_kv_events


# ------------------------------------------------------------ siblings in one step


def test_identical_prompts_admitted_together_prefill_once() -> None:
    scheduler = Scheduler(BlockManager(64, PAGE), max_batch=8, max_prefill_tokens=4096)
    prompt = list(range(100))
    sequences = [Sequence.from_prompt(f"s{n}", prompt) for n in range(4)]
    for sequence in sequences:
        scheduler.add(sequence)
    first = scheduler.schedule()
    assert first.prefill == sequences[:1] and scheduler.num_deferred == 3  # the others wait for its pages
    for sequence in first.sequences:
        record_token(sequence, 0, scheduler.blocks)
    second = scheduler.schedule()
    assert second.prefill == sequences[1:] and all(s.num_cached == 96 for s in sequences[1:])
    stats = scheduler.blocks.stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (400, 3 * 96)


def test_a_sibling_launched_ahead_waits_one_more_schedule_for_the_pages_in_flight() -> None:
    scheduler = Scheduler(BlockManager(64, PAGE), max_batch=8, max_prefill_tokens=4096)
    prompt = list(range(40))
    a, b = Sequence.from_prompt("a", prompt), Sequence.from_prompt("b", prompt)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.schedule().prefill == [a]
    assert scheduler.schedule().prefill == []  # a's step not collected yet: its pages are not cached
    record_token(a, 0, scheduler.blocks)
    scheduler.schedule()
    assert b.status is SequenceStatus.RUNNING and b.num_cached == 32


def test_siblings_of_a_page_aligned_prompt_read_all_its_pages_and_feed_its_last_token() -> None:
    """A prompt of whole pages (hashed to its last page, as a request carrying prefix hashes is):
    the siblings wait for every page of it, then each feeds the last token alone."""
    scheduler = Scheduler(BlockManager(64, PAGE), max_batch=8, max_prefill_tokens=4096)
    prompt = list(range(2 * PAGE))
    sequences = [Sequence.from_prompt(f"s{n}", prompt) for n in range(4)]
    for sequence in sequences:
        scheduler.blocks.hash_pages(sequence, 2)
        scheduler.add(sequence)
    assert scheduler.schedule().prefill == sequences[:1] and scheduler.num_deferred == 3
    record_token(sequences[0], 0, scheduler.blocks)
    second = scheduler.schedule()
    assert second.prefill == sequences[1:] and all(s.num_new == 1 for s in sequences[1:])
    assert scheduler.num_deferred == 3


def test_prompts_sharing_no_page_are_admitted_together() -> None:
    scheduler = Scheduler(BlockManager(64, PAGE), max_batch=8, max_prefill_tokens=4096)
    sequences = [Sequence.from_prompt(f"s{n}", [n] * 40) for n in range(3)]
    for sequence in sequences:
        scheduler.add(sequence)
    assert scheduler.schedule().prefill == sequences and scheduler.num_deferred == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["one at a time", "launched ahead"])
def test_siblings_reaching_the_backend_together_prefill_once_with_the_same_tokens(overlap: bool) -> None:
    prompt = [(7 * k + 3) % 256 for k in range(100)]

    def siblings() -> list[GenerationRequest]:
        return [GenerationRequest(f"s{n}", prompt, max_tokens=6, seed=n) for n in range(4)]

    alone = {
        rid: outs for rid, outs in run_to_end(TorchBackend(engine_options(prefix_caching=False)), *siblings()).items()
    }
    backend = TorchBackend(engine_options(overlap_steps=overlap))
    together = run_to_end(backend, *siblings())
    assert {rid: [t for o in outs for t in o.new_tokens] for rid, outs in together.items()} == {
        rid: [t for o in outs for t in o.new_tokens] for rid, outs in alone.items()
    }
    stats = backend.prefix_cache_stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (400, 3 * 96)  # prefilled once, read three times
