"""Every supported family served by the torch backend on CPU, against transformers: greedy
tokens equal to ``generate`` alone, in a concurrent batch and with staggered joins (steps one
at a time and launched ahead), the same with prefix caching on and off, seeded sampling
unchanged by batch neighbours, a request resumed on another engine from its streamed tokens
(``resume_tokens``), and EOS ids listed in ``generation_config.json``. Checkpoints: tiny ones
written by transformers' ``save_pretrained`` (tests/torch/families.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engines.backend import GenerationRequest, TokenOutput
from engines.torch_backend.backend import TorchBackend
from tests.torch.families import FAMILIES, Checkpoints
from tests.torch.reference import engine_options, hf_greedy, run_to_end

PROMPTS = [[5, 9, 200, 17, 3, 88, 41], [1], list(range(30, 55)), [250, 7, 7, 7, 9, 10, 11, 12, 13]]
TOKENS = 16
PREFIX = [(7 * k + 3) % 256 for k in range(40)]  # two full 16-token pages and 8 tokens

pytestmark = pytest.mark.parametrize("family", FAMILIES)


def greedy(rid: str, prompt: list[int], max_tokens: int = TOKENS) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens=max_tokens, temperature=0.0)


def tokens(outputs: dict[str, list[TokenOutput]]) -> dict[str, list[int]]:
    return {rid: [token for output in outs for token in output.new_tokens] for rid, outs in outputs.items()}


@pytest.mark.parametrize("overlap", [False, True], ids=["one at a time", "launched ahead"])
def test_greedy_tokens_equal_transformers_alone_batched_and_staggered(
    checkpoints: Checkpoints, family: str, overlap: bool
) -> None:
    checkpoint = checkpoints.get(family)
    expected = {f"p{i}": hf_greedy(checkpoint.reference, prompt, TOKENS) for i, prompt in enumerate(PROMPTS)}
    backend = TorchBackend(engine_options(overlap_steps=overlap), str(checkpoint.path))
    alone: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        alone |= tokens(run_to_end(backend, greedy(f"p{i}", prompt)))
    assert alone == expected
    assert tokens(run_to_end(backend, *[greedy(f"p{i}", prompt) for i, prompt in enumerate(PROMPTS)])) == expected
    staggered: dict[str, list[int]] = {rid: [] for rid in expected}
    pending = [greedy(f"p{i}", prompt) for i, prompt in enumerate(PROMPTS)]
    while pending or backend.has_work():
        if pending:  # one joins the running batch at each step
            backend.add(pending.pop(0))
        for output in backend._step():
            staggered[output.request_id] += output.new_tokens
    assert staggered == expected


def test_prefix_caching_on_and_off_give_transformers_tokens(checkpoints: Checkpoints, family: str) -> None:
    checkpoint = checkpoints.get(family)
    prompts = {f"s{i}": PREFIX + suffix for i, suffix in enumerate([[1], [2, 3, 4], list(range(60, 70))])}
    expected = {rid: hf_greedy(checkpoint.reference, prompt, 10) for rid, prompt in prompts.items()}
    for caching in (True, False):
        backend = TorchBackend(engine_options(prefix_caching=caching), str(checkpoint.path))
        first = tokens(run_to_end(backend, greedy("s0", prompts["s0"], 10)))  # its pages are cached when it ends
        rest = tokens(run_to_end(backend, *[greedy(rid, prompts[rid], 10) for rid in ("s1", "s2")]))
        assert first | rest == expected, f"prefix caching {caching}"
        assert (backend.prefix_cache_stats().hit_tokens > 0) is caching


def test_seeded_sampling_is_unchanged_by_batch_neighbours(checkpoints: Checkpoints, family: str) -> None:
    backend = TorchBackend(engine_options(), str(checkpoints.get(family).path))

    def sampled(rid: str, prompt: list[int], seed: int, **params: float) -> GenerationRequest:
        return GenerationRequest(rid, prompt, max_tokens=TOKENS, temperature=1.0, seed=seed, **params)  # type: ignore[arg-type]

    alone = tokens(run_to_end(backend, sampled("alone", PROMPTS[0], 42)))["alone"]
    neighbours = [sampled(f"n{i}", PROMPTS[i % 4], seed=i, top_k=5 * i, top_p=0.5 + i / 20) for i in range(5)]
    crowded = tokens(run_to_end(backend, *neighbours[:2], sampled("crowded", PROMPTS[0], 42), *neighbours[2:]))
    assert crowded["crowded"] == alone
    assert tokens(run_to_end(backend, sampled("other", PROMPTS[0], 43)))["other"] != alone


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_with_the_exact_next_token(
    checkpoints: Checkpoints, family: str, params: dict[str, float]
) -> None:
    path = str(checkpoints.get(family).path)
    first, second = TorchBackend(engine_options(), path), TorchBackend(engine_options(), path)
    whole = tokens(run_to_end(first, GenerationRequest("r", PROMPTS[2], max_tokens=TOKENS, **params)))["r"]  # type: ignore[arg-type]
    cut = 6
    resumed = GenerationRequest("r", PROMPTS[2], max_tokens=TOKENS, resume_tokens=tuple(whole[:cut]), **params)  # type: ignore[arg-type]
    assert tokens(run_to_end(second, resumed))["r"] == whole[cut:]


def test_eos_ids_listed_in_generation_config_stop_the_request(
    checkpoints: Checkpoints, family: str, tmp_path: Path
) -> None:
    source = checkpoints.get(family).path
    free = tokens(run_to_end(TorchBackend(engine_options(), str(source)), greedy("r", PROMPTS[0], 12)))["r"]
    eos = free[4]
    model_dir = tmp_path / family
    shutil.copytree(source, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [255, eos]}))
    backend = TorchBackend(engine_options(overlap_steps=True), str(model_dir))
    assert backend.config.eos_token_ids == (255, eos)
    outputs = run_to_end(backend, greedy("r", PROMPTS[0], 12))["r"]
    assert tokens({"r": outputs})["r"] == free[: free.index(eos) + 1] and outputs[-1].finish_reason == "stop"
