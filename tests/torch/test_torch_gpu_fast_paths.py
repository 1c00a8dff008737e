"""The CUDA fast paths of the torch backend: the Triton paged decode kernel, compiled
element-wise pieces, decode CUDA graphs per batch bucket, overlapped steps and prefix caching,
against transformers and against the same engine with every fast path off, for the default
model and for every supported family. Skipped without a CUDA device (run them with ``pytest -m gpu tests/torch/test_torch_gpu*.py``; the kernel tests of test_torch_kernels.py run on the device too, unmarked)."""

from __future__ import annotations

import copy

import pytest
import torch

from engines.backend import GenerationRequest
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.kernels import EAGER
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.setup import MOE_EAGER
from tests.torch.families import FAMILIES, Checkpoints
from tests.torch.reference import engine_options, hf_model, random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SEED = 4


def options(**overrides: object) -> TorchOptions:
    values: dict[str, object] = {"device": "cuda", "kv_cache_gb": 0.25, "max_batch": 32, "model_seed": SEED}
    values.update(overrides)
    return engine_options(**values)


def slow(**overrides: object) -> TorchOptions:
    """Every CUDA fast path off: eager kernels, no graphs, one step at a time."""
    return options(cuda_graphs=False, torch_compile=False, overlap_steps=False, **overrides)


def generate(backend: TorchBackend, *requests: GenerationRequest) -> dict[str, list[int]]:
    for request in requests:
        backend.add(request)
    out: dict[str, list[int]] = {}
    while backend.has_work():
        for output in backend._step():
            out.setdefault(output.request_id, []).extend(output.new_tokens)
    return out


def greedy(rid: str, prompt: list[int], max_tokens: int = 16) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens=max_tokens, temperature=0.0)


def prompts(count: int) -> dict[str, list[int]]:
    return {f"p{i}": [(11 * i + 3 * k) % 256 for k in range(2 + 7 * i % 50)] for i in range(count)}


def test_the_fast_paths_are_on_by_default() -> None:
    backend = TorchBackend(options())
    assert backend.kernels.paged_decode is not None and backend.kernels.rms_norm is not EAGER.rms_norm
    assert backend.graphs is not None and backend.graphs.buckets == [1, 2, 4, 8, 16, 32]
    assert "Triton paged decode" in backend.kernels.describe()
    path = backend.execution_path()
    assert path.fast and path.failures == (), path.describe()
    TorchBackend(options(require_fast_path=True))  # starts: every piece is on
    off = TorchBackend(slow())
    assert off.graphs is None and off.kernels.rms_norm is EAGER.rms_norm
    assert off.execution_path().missing() == ["CUDA graphs", "compiled pieces"]


def test_float32_greedy_with_graphs_equals_transformers() -> None:
    config = ModelConfig()
    backend = TorchBackend(options(dtype="float32"))
    reference = hf_model(config, random_weights(config, seed=SEED)).cuda()
    chosen = prompts(5)
    ours = generate(backend, *[greedy(rid, prompt) for rid, prompt in chosen.items()])
    for rid, prompt in chosen.items():
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert ours[rid] == expected[0, len(prompt) :].tolist(), rid


@pytest.mark.parametrize("count", [1, 3, 17, 32])
def test_every_bucket_gives_the_tokens_of_the_slow_path(count: int) -> None:
    chosen = prompts(count)
    requests = [greedy(rid, prompt, 24) for rid, prompt in chosen.items()]
    fast = generate(TorchBackend(options(dtype="float32")), *requests)
    assert fast == generate(TorchBackend(slow(dtype="float32")), *requests)


def test_bf16_sampled_requests_finish_with_their_counts_and_stop_strings() -> None:
    backend = TorchBackend(options())
    requests = [
        GenerationRequest(f"s{i}", f"request {i}: once upon a time", max_tokens=5 + i, seed=i, top_k=50)
        for i in range(24)
    ]
    counts = {rid: len(tokens) for rid, tokens in generate(backend, *requests).items()}
    assert counts == {f"s{i}": 5 + i for i in range(24)}
    assert generate(backend, *requests[:3]) == generate(backend, *requests[:3])  # seeded: repeatable


def test_prefix_caching_on_cuda_gives_the_uncached_tokens() -> None:
    prefix = [(5 * k + 1) % 256 for k in range(100)]
    requests = [greedy(f"r{i}", [*prefix, i, i + 1], 20) for i in range(12)]
    cached = TorchBackend(options(dtype="float32"))
    generate(cached, greedy("warm", [*prefix, 255]))
    got = generate(cached, *requests)
    assert cached.prefix_cache_stats().hit_tokens >= 12 * 96
    assert got == generate(TorchBackend(slow(dtype="float32", prefix_caching=False)), *requests)


async def test_resume_captures_the_graphs_again_and_requests_continue() -> None:
    backend = TorchBackend(options(dtype="float32"))
    requests = [GenerationRequest(f"r{i}", f"suspend {i}", max_tokens=40, seed=i) for i in range(6)]
    expected = generate(TorchBackend(slow(dtype="float32")), *requests)
    for request in requests:
        backend.add(request)
    got: dict[str, list[int]] = {request.request_id: [] for request in requests}
    for _ in range(5):
        for output in await backend.step():
            got[output.request_id] += output.new_tokens
    before = backend.graphs
    await backend.suspend()
    assert backend.graphs is None
    await backend.resume()
    assert backend.graphs is not None and backend.graphs is not before
    while backend.has_work():
        for output in await backend.step():
            got[output.request_id] += output.new_tokens
    assert got == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_on_the_fast_path_gives_transformers_and_slow_path_tokens(
    checkpoints: Checkpoints, family: str
) -> None:
    """float32: graphs (with the window in the paged kernel, the experts grouped) equal
    transformers on the GPU and the same engine with every fast path off, for a batch whose
    bucket has padding rows and prompts longer than Mistral's 8-token window."""
    checkpoint = checkpoints.get(family)
    chosen = prompts(5)
    requests = [greedy(rid, prompt, 20) for rid, prompt in chosen.items()]
    fast = TorchBackend(options(dtype="float32"), str(checkpoint.path))
    # torch's float32 grouped GEMM loops on the host: float32 experts run eager, and say so.
    path = fast.execution_path()
    assert (fast.graphs is None) == (MOE_EAGER in path.failures), path.describe()
    got = generate(fast, *requests)
    assert got == generate(TorchBackend(slow(dtype="float32"), str(checkpoint.path)), *requests)
    reference = copy.deepcopy(checkpoint.reference).cuda()
    for rid, prompt in chosen.items():
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=20,
                min_new_tokens=20,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert got[rid] == expected[0, len(prompt) :].tolist(), rid


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_the_whole_fast_path_in_bf16(checkpoints: Checkpoints, family: str) -> None:
    """bf16, as served: no piece falls back (no "MoE runs eager"), and sampled requests finish."""
    backend = TorchBackend(options(require_fast_path=True), str(checkpoints.get(family).path))
    path = backend.execution_path()
    assert path.fast and path.failures == (), path.describe()
    requests = [GenerationRequest(f"s{i}", list(range(3 + i)), max_tokens=12, seed=i) for i in range(20)]
    assert {rid: len(tokens) for rid, tokens in generate(backend, *requests).items()} == {
        f"s{i}": 12 for i in range(20)
    }
