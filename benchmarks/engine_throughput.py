"""Generated tokens per second of the torch engine with 1, 8, 32 and 128 concurrent requests,
against transformers' ``generate`` one request at a time on the same weights, measured in the
same run.

    python benchmarks/engine_throughput.py [--threads 1] [--max-tokens 64] [--device cuda]

The engine is the torch backend itself (add, then step until every request finished), with
its default settings and the default random model; the time includes prefill. Both sides
decode greedily and always produce ``--max-tokens`` tokens (the default model has no EOS).
Ratios are what to compare: absolute figures move with the machine and its load. Each
figure is the best of ``--repeats`` rounds, and the rounds interleave baseline and engine, so
a burst of load from elsewhere on the machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

import torch

from engines.backend import GenerationRequest
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.weights import random_weights
from service.settings import Settings


def prompts(count: int, length: int) -> list[str]:
    base = "the engine batches requests, the baseline runs them one by one "
    return [(f"request {i}: " + base * 4)[:length] for i in range(count)]


async def engine_tokens_per_s(backend: TorchBackend, concurrency: int, prompt_len: int, max_tokens: int) -> float:
    for i, prompt in enumerate(prompts(concurrency, prompt_len)):
        backend.add(GenerationRequest(f"c{concurrency}-{i}", prompt, max_tokens=max_tokens, temperature=0.0))
    generated = 0
    start = time.perf_counter()
    while backend.has_work():
        generated += sum(len(output.new_tokens) for output in await backend.step())
    elapsed = time.perf_counter() - start
    assert generated == concurrency * max_tokens, (generated, concurrency * max_tokens)
    return generated / elapsed


def reference_model(backend: TorchBackend, seed: int) -> Any:
    """transformers' LlamaForCausalLM with the engine's weights, device and dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**backend.config.to_hf()))
    model.load_state_dict(random_weights(backend.config, seed))
    return model.to(device=backend.device, dtype=backend.dtype).eval()


def baseline_tokens_per_s(backend: TorchBackend, model: Any, requests: int, prompt_len: int, max_tokens: int) -> float:
    def generate(prompt: str) -> int:
        ids = torch.tensor([backend.tokenizer.encode(prompt)], device=backend.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        return out.shape[1] - ids.shape[1]

    with torch.inference_mode():
        start = time.perf_counter()
        generated = sum(generate(prompt) for prompt in prompts(requests, prompt_len))
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return generated / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt length in bytes (= tokens)")
    parser.add_argument("--baseline-requests", type=int, default=8, help="requests run through transformers, one at a time")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads, the engine's cpu_threads setting (default: torch's choice)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the best round")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    settings = Settings(device=args.device, max_batch=max(args.concurrency), cpu_threads=args.threads)
    backend = TorchBackend(settings)
    params = sum(p.numel() for p in backend.model.parameters()) / 1e6
    print(f"default model: {params:.1f} M parameters, {backend.dtype} on {backend.device}, {torch.get_num_threads()} threads; "
          f"prompts of {args.prompt_len} tokens, {args.max_tokens} generated tokens per request, greedy")
    reference = reference_model(backend, settings.model_seed)
    baseline_best = 0.0
    engine_best = dict.fromkeys(args.concurrency, 0.0)
    await engine_tokens_per_s(backend, 4, args.prompt_len, 8)  # warm-up
    baseline_tokens_per_s(backend, reference, 1, args.prompt_len, 8)
    for _ in range(args.repeats):
        baseline_best = max(baseline_best, baseline_tokens_per_s(backend, reference, args.baseline_requests, args.prompt_len, args.max_tokens))
        for concurrency in args.concurrency:
            rate = await engine_tokens_per_s(backend, concurrency, args.prompt_len, args.max_tokens)
            engine_best[concurrency] = max(engine_best[concurrency], rate)
    print(f"{'baseline: transformers generate, one at a time':<48} {baseline_best:10.0f} tokens/s")
    for concurrency, rate in engine_best.items():
        print(f"{f'engine, {concurrency} concurrent requests':<48} {rate:10.0f} tokens/s   {rate / baseline_best:6.1f}x baseline")


if __name__ == "__main__":
    asyncio.run(main())
