"""The torch backend with prefix caching and overlapped steps, on CPU: greedy tokens equal to
transformers with and without the cache, suspend, abort, and the same outputs whether step
n + 1 is launched before step n's tokens are emitted or not."""

from __future__ import annotations

import pytest

from engines.backend import GenerationRequest, TokenOutput
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.batch import prefill_groups
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.sequence import Sequence
from tests.torch.reference import engine_options, hf_greedy, hf_model, random_weights, run_to_end

SEED = 5
PREFIX = [(7 * k + 3) % 256 for k in range(40)]  # two full 16-token pages and 8 tokens


def tokens_of(backend: TorchBackend, *requests: GenerationRequest) -> dict[str, list[int]]:
    return {
        rid: [t for output in outs for t in output.new_tokens] for rid, outs in run_to_end(backend, *requests).items()
    }


def greedy(rid: str, prompt: list[int], max_tokens: int = 10) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens=max_tokens, temperature=0.0)


@pytest.fixture(scope="module")
def reference() -> object:
    config = ModelConfig()
    return hf_model(config, random_weights(config, seed=SEED))


def test_greedy_tokens_with_a_shared_prefix_equal_transformers_with_and_without_the_cache(reference: object) -> None:
    suffixes = [[1], [2, 3, 4], [5] * 9, list(range(60, 80))]
    prompts = {f"s{i}": PREFIX + suffix for i, suffix in enumerate(suffixes)}
    expected = {rid: hf_greedy(reference, prompt, 10) for rid, prompt in prompts.items()}
    results = {}
    for caching in (True, False):
        backend = TorchBackend(engine_options(model_seed=SEED, prefix_caching=caching))
        first = tokens_of(backend, greedy("s0", prompts["s0"]))  # alone: its pages are cached when it ends
        rest = tokens_of(backend, *[greedy(rid, prompt) for rid, prompt in prompts.items() if rid != "s0"])
        results[caching] = first | rest
        stats = backend.prefix_cache_stats()
        assert (stats.hit_tokens > 0) is caching
    assert results[True] == expected
    assert results[False] == expected


def test_a_step_prefilling_a_long_prompt_beside_cached_siblings_gives_each_transformers_tokens(
    reference: object,
) -> None:
    """One step prefills a fresh 120-token prompt and two that read PREFIX's pages from the cache
    (9 and 10 tokens fed): two attention groups, the siblings not padded to the long prompt."""
    backend = TorchBackend(engine_options(model_seed=SEED))
    tokens_of(backend, greedy("first", PREFIX))
    prompts = {"long": [(5 * k + 1) % 256 for k in range(120)], "a": PREFIX + [1], "b": PREFIX + [2, 3]}
    for rid, prompt in prompts.items():
        backend.add(greedy(rid, prompt))
    scheduled = backend.scheduler.schedule()
    assert [[s.num_new for s in group] for group in prefill_groups(scheduled.prefill)] == [[120], [10, 9]]
    backend.scheduler.preempt_all()  # schedule again, inside the backend's step
    expected = {rid: hf_greedy(reference, prompt, 10) for rid, prompt in prompts.items()}
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while backend.has_work():
        for output in backend._step():
            got[output.request_id] += output.new_tokens
    assert got == expected


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_read_whole_from_the_cache_feeds_its_last_token_and_gives_transformers_tokens(
    reference: object, overlap: bool
) -> None:
    """Two whole pages cached: the samples that follow feed one token each, whose keys go to
    the scratch page, and leave the shared pages as they were for the next reader."""
    backend = TorchBackend(engine_options(model_seed=SEED, overlap_steps=overlap))
    prompt = PREFIX[:32]
    expected = hf_greedy(reference, prompt, 10)
    assert tokens_of(backend, greedy("first", prompt)) == {"first": expected}
    cache = backend.runner.kv_cache
    assert cache is not None
    before = cache.clone()
    assert tokens_of(backend, greedy("a", prompt), greedy("b", prompt)) == {"a": expected, "b": expected}
    changed = (cache != before).any(dim=(0, 2, 3, 4, 5)).nonzero().flatten().tolist()
    shared = backend.scheduler.blocks.match(Sequence.from_prompt("probe", prompt))
    assert len(shared) == 2 and changed and not set(changed) & set(shared)  # the samples' own pages changed
    assert tokens_of(backend, greedy("last", prompt)) == {"last": expected}
    assert backend.prefix_cache_stats().hit_tokens == 3 * 31


def test_a_follow_up_turn_reuses_the_generated_tokens_pages(reference: object) -> None:
    backend = TorchBackend(engine_options(model_seed=SEED))
    first = tokens_of(backend, greedy("turn1", PREFIX, max_tokens=30))["turn1"]
    follow_up = PREFIX + first + [9, 8, 7]
    before = backend.prefix_cache_stats().hit_tokens
    assert tokens_of(backend, greedy("turn2", follow_up))["turn2"] == hf_greedy(reference, follow_up, 10)
    assert backend.prefix_cache_stats().hit_tokens - before == 64  # 4 of the 73 tokens' pages were cached


def test_abort_of_a_sharer_leaves_the_others_pages_intact(reference: object) -> None:
    backend = TorchBackend(engine_options(model_seed=SEED))
    tokens_of(backend, greedy("warm", PREFIX + [1]))
    backend.add(greedy("a", PREFIX + [2], max_tokens=20))
    backend.add(greedy("b", PREFIX + [3], max_tokens=20))
    got: list[int] = []
    for _ in range(3):
        got += [t for output in backend._step() if output.request_id == "b" for t in output.new_tokens]
    assert backend.abort("a")
    while backend.has_work():
        got += [t for output in backend._step() for t in output.new_tokens]
    assert got == hf_greedy(reference, PREFIX + [3], 20)
    assert tokens_of(backend, greedy("c", PREFIX + [4]))["c"] == hf_greedy(reference, PREFIX + [4], 10)


@pytest.mark.parametrize("overlap", [False, True])
async def test_suspend_forgets_the_cache_and_requests_resume_with_the_same_tokens(overlap: bool) -> None:
    backend = TorchBackend(engine_options(model_seed=SEED, overlap_steps=overlap))
    requests = [GenerationRequest(f"r{i}", PREFIX + [i], max_tokens=12, seed=i) for i in range(3)]
    expected = tokens_of(TorchBackend(engine_options(model_seed=SEED, prefix_caching=False)), *requests)
    for request in requests:
        backend.add(request)
    got: dict[str, list[int]] = {request.request_id: [] for request in requests}
    for _ in range(4):
        for output in await backend.step():
            got[output.request_id] += output.new_tokens
    assert backend.prefix_cache_stats().cached_pages > 0
    await backend.suspend()
    assert backend.prefix_cache_stats().cached_pages == 0 and not backend.has_work()
    await backend.resume()
    while backend.has_work():
        for output in await backend.step():
            got[output.request_id] += output.new_tokens
    assert got == expected


def _mixed_requests(stop: str) -> list[GenerationRequest]:
    return [
        GenerationRequest("greedy", "Once upon a time", max_tokens=14, temperature=0.0),
        GenerationRequest("sampled", "Once upon a time", max_tokens=9, seed=3, top_k=20),
        GenerationRequest("stopped", "Once upon a time", max_tokens=30, seed=4, stop=(stop,)),
        GenerationRequest("short", "Hi", max_tokens=1, seed=5),
        GenerationRequest("shared", PREFIX, max_tokens=6, temperature=0.0),
    ]


def test_overlapped_steps_give_the_same_outputs() -> None:
    first = TorchBackend(engine_options(model_seed=SEED, overlap_steps=False))
    free = "".join(
        output.text
        for output in run_to_end(first, GenerationRequest("f", "Once upon a time", max_tokens=30, seed=4))["f"]
    )
    start = next(i for i in range(6, len(free) - 1) if "\ufffd" not in free[i : i + 2])
    stop = free[start : start + 2]
    plain = TorchBackend(engine_options(model_seed=SEED, overlap_steps=False))  # its cache cold, as the other's
    expected = run_to_end(plain, *_mixed_requests(stop))
    assert expected["stopped"][-1].finish_reason == "stop" and len(expected["stopped"]) < 30
    overlapped = TorchBackend(engine_options(model_seed=SEED, overlap_steps=True))
    assert run_to_end(overlapped, *_mixed_requests(stop)) == expected
    assert not overlapped.has_work() and overlapped.scheduler.blocks.num_free == overlapped.scheduler.blocks.num_blocks


def test_abort_while_the_next_step_is_launched_drops_its_token_and_frees_its_pages() -> None:
    backend = TorchBackend(engine_options(model_seed=SEED, overlap_steps=True))
    blocks = backend.scheduler.blocks
    backend.add(greedy("kept", [1, 2, 3], max_tokens=8))
    backend.add(greedy("gone", [4, 5, 6], max_tokens=8))
    first = backend._step()  # returns step 1's tokens; step 2 is launched
    assert {output.request_id for output in first} == {"kept", "gone"}
    assert backend.abort("gone")
    rest: list[TokenOutput] = []
    while backend.has_work():
        rest += backend._step()
    assert {output.request_id for output in rest} == {"kept"}
    assert len(rest) == 7 and blocks.num_free == blocks.num_blocks


def test_every_output_says_how_many_prompt_tokens_the_prefix_cache_held_when_first_scheduled() -> None:
    """What ``Final.timings.cached_prompt_tokens`` reports: the full pages of a prompt another
    request computed (32 of PREFIX's 40 tokens), 0 for the first."""
    backend = TorchBackend(engine_options(model_seed=SEED))
    first = run_to_end(backend, greedy("first", PREFIX, max_tokens=3))["first"]
    second = run_to_end(backend, greedy("second", PREFIX + [1, 2], max_tokens=3))["second"]
    assert {output.cached_tokens for output in first} == {0}
    assert {output.cached_tokens for output in second} == {32}
