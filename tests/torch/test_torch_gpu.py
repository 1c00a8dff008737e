"""The torch backend on CUDA: bf16 by default, the KV cache goes back to the device on
suspend, cudaProfilerStart/Stop, and the same greedy tokens as transformers on the GPU.
Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from engines.backend import GenerationRequest
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.options import TorchOptions
from tests.torch.reference import engine_options, hf_model, random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_settings(**overrides: object) -> TorchOptions:
    values: dict[str, object] = {"device": "cuda", "kv_cache_gb": 0.25}
    values.update(overrides)
    return engine_options(**values)


def generate(backend: TorchBackend, *requests: GenerationRequest) -> dict[str, list[int]]:
    for request in requests:
        backend.add(request)
    out: dict[str, list[int]] = {}
    while backend.has_work():
        for output in backend._step():
            out.setdefault(output.request_id, []).extend(output.new_tokens)
    return out


def test_bf16_by_default_on_cuda() -> None:
    backend = TorchBackend(cuda_settings())
    assert backend.dtype == torch.bfloat16 and backend.device.type == "cuda"
    assert len(generate(backend, GenerationRequest("r", "Hello", max_tokens=8))["r"]) == 8


def test_float32_greedy_on_cuda_matches_transformers_on_cuda() -> None:
    config = ModelConfig()
    backend = TorchBackend(cuda_settings(dtype="float32", model_seed=4))
    reference = hf_model(config, random_weights(config, seed=4)).cuda()
    prompts = [[5, 6, 7, 8], list(range(40, 90))]
    ours = generate(
        backend, *[GenerationRequest(f"p{i}", p, max_tokens=16, temperature=0.0) for i, p in enumerate(prompts)]
    )
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert ours[f"p{i}"] == expected[0, len(prompt) :].tolist()


async def test_suspend_gives_the_cache_memory_back_to_the_device() -> None:
    backend = TorchBackend(cuda_settings(kv_cache_gb=1.0, max_batch=128, max_context=2048))
    cache = backend.runner.kv_cache
    assert cache is not None
    cache_bytes = cache.numel() * cache.element_size()
    assert cache_bytes >= 128 << 20
    expected = generate(backend, GenerationRequest("r", "Suspend me", max_tokens=30, seed=3))["r"]
    backend.add(GenerationRequest("r", "Suspend me", max_tokens=30, seed=3))
    got = [token for output in await backend.step() for token in output.new_tokens]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    await backend.suspend()
    torch.cuda.synchronize()
    released = before - torch.cuda.memory_allocated()
    assert released >= cache_bytes
    await backend.resume()
    assert torch.cuda.memory_allocated() >= before - (64 << 20)
    while backend.has_work():
        got += [token for output in await backend.step() for token in output.new_tokens]
    assert got == expected


def test_cuda_profiler_start_and_stop() -> None:
    backend = TorchBackend(cuda_settings())
    assert "cudaProfilerStart" in backend.start_profiler()
    assert "cudaProfilerStop" in backend.stop_profiler()
