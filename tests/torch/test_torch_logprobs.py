"""The torch backend's log-probabilities against transformers' log-softmax of one full-sequence
forward pass (the trainer's view), CPU float32: generated tokens (raw, with their top
alternatives), prompt tokens (a cached prefix recomputed), processed ones (of the distribution
sampled from), within a batch and with steps launched ahead."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engines.backend import GenerationRequest, TokenOutput
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from tests.torch.reference import engine_options, hf_model, random_weights, run_to_end

SEED = 5
PROMPT = [5, 9, 200, 17, 3, 88, 41, 120, 7, 64]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference() -> Any:
    return hf_model(ModelConfig(), random_weights(ModelConfig(), seed=SEED))


@pytest.fixture(scope="module", params=[False, True], ids=["one at a time", "launched ahead"])
def backend(request: pytest.FixtureRequest) -> TorchBackend:
    return TorchBackend(engine_options(model_seed=SEED, overlap_steps=request.param, kv_block_size=4))


def full_logprobs(reference: Any, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]``: row i is the log-softmax after tokens[: i + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(reference(torch.tensor([tokens])).logits[0].float(), dim=-1)


def generated(outputs: list[TokenOutput]) -> tuple[list[int], list[float], list[Any]]:
    tokens = [token for output in outputs for token in output.new_tokens]
    logprobs = [value for output in outputs for value in output.logprobs or ()]
    top = [alternatives for output in outputs for alternatives in output.top_logprobs or ()]
    return tokens, logprobs, top


def test_greedy_logprobs_and_alternatives_match_one_full_forward_pass(backend: TorchBackend, reference: Any) -> None:
    request = GenerationRequest("g", PROMPT, max_tokens=8, temperature=0.0, logprobs=3)
    tokens, logprobs, top = generated(run_to_end(backend, request)["g"])
    expected = full_logprobs(reference, PROMPT + tokens)[len(PROMPT) - 1 : -1]
    assert len(logprobs) == len(top) == len(tokens) == 8
    for n, token in enumerate(tokens):
        assert abs(logprobs[n] - expected[n, token].item()) <= TOLERANCE
        values, ids = expected[n].topk(3)
        assert [token_id for token_id, _ in top[n]] == ids.tolist()
        assert max(abs(value - want) for (_, value), want in zip(top[n], values.tolist(), strict=True)) <= TOLERANCE
        assert top[n][0] == (token, logprobs[n])  # greedy: the token is the top one, the very same float


def test_prompt_logprobs_are_recomputed_even_when_the_prefix_is_cached(backend: TorchBackend, reference: Any) -> None:
    run_to_end(backend, GenerationRequest("warm", PROMPT, max_tokens=1, temperature=0.0))  # caches PROMPT's pages
    before = backend.prefix_cache_stats()
    outputs = run_to_end(backend, GenerationRequest("p", PROMPT, max_tokens=2, temperature=0.0, prompt_logprobs=2))
    assert backend.prefix_cache_stats().hit_tokens == before.hit_tokens  # its cached prefix was not reused
    run_to_end(backend, GenerationRequest("again", PROMPT, max_tokens=1, temperature=0.0))
    assert backend.prefix_cache_stats().hit_tokens > before.hit_tokens  # without prompt logprobs it is
    first, second = outputs["p"]
    assert second.prompt is None and first.prompt is not None and first.logprobs is None  # not asked
    prompt = first.prompt
    expected = full_logprobs(reference, PROMPT)
    assert prompt.token_ids == PROMPT and prompt.logprobs[0] is None and prompt.top_logprobs is not None
    for position in range(1, len(PROMPT)):
        value = prompt.logprobs[position]
        assert value is not None and abs(value - expected[position - 1, PROMPT[position]].item()) <= TOLERANCE
        alternatives = prompt.top_logprobs[position]
        assert alternatives is not None
        assert [token for token, _ in alternatives] == expected[position - 1].topk(2).indices.tolist()


def test_a_request_alone_and_in_a_batch_get_the_same_logprobs(backend: TorchBackend) -> None:
    alone = generated(
        run_to_end(backend, GenerationRequest("a", PROMPT, max_tokens=6, temperature=0.0, logprobs=1))["a"]
    )
    others = [GenerationRequest(f"o{i}", [(i * 31 + k) % 256 for k in range(3 + i)], max_tokens=6) for i in range(7)]
    batch = run_to_end(backend, *others, GenerationRequest("a", PROMPT, max_tokens=6, temperature=0.0, logprobs=1))
    together = generated(batch["a"])
    assert together[0] == alone[0]
    assert max(abs(a - b) for a, b in zip(together[1], alone[1], strict=True)) <= TOLERANCE
    assert all(output.logprobs is None for rid in batch if rid != "a" for output in batch[rid])


def test_processed_logprobs_are_of_the_distribution_sampled_from(backend: TorchBackend, reference: Any) -> None:
    temperature, top_k = 0.7, 5
    request = GenerationRequest(
        "s", PROMPT, max_tokens=6, temperature=temperature, top_k=top_k, seed=3, logprobs=8, logprobs_mode="processed"
    )
    tokens, logprobs, top = generated(run_to_end(backend, request)["s"])
    with torch.inference_mode():
        logits = reference(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float() / temperature
    for n, token in enumerate(tokens):
        kept = logits[n].topk(top_k)
        distribution = dict(zip(kept.indices.tolist(), torch.log_softmax(kept.values, -1).tolist(), strict=True))
        assert abs(logprobs[n] - distribution[token]) <= TOLERANCE
        assert len(top[n]) == top_k  # the others have probability 0: left out
        assert all(abs(value - distribution[token_id]) <= TOLERANCE for token_id, value in top[n])
    greedy = GenerationRequest("gp", PROMPT, max_tokens=2, temperature=0.0, logprobs=2, logprobs_mode="processed")
    outputs = run_to_end(backend, greedy)["gp"]
    assert [output.logprobs for output in outputs] == [[0.0], [0.0]]
    assert [output.top_logprobs for output in outputs] == [[[(output.new_tokens[0], 0.0)]] for output in outputs]


def test_every_logprob_is_finite_and_tokens_have_their_bytes(backend: TorchBackend) -> None:
    request = GenerationRequest("f", PROMPT, max_tokens=3, temperature=1.0, seed=1, logprobs=20, prompt_logprobs=20)
    outputs = run_to_end(backend, request)["f"]
    values = [value for output in outputs for value in output.logprobs or ()]
    values += [value for output in outputs for alternatives in output.top_logprobs or () for _, value in alternatives]
    assert values and all(math.isfinite(value) for value in values)
    assert backend.token_bytes([104, 300 % 256]) == {104: b"h", 44: b","}
