"""Generated tokens per second of the torch engine with 1, 8, 32 and 128 concurrent requests,
against transformers' ``generate`` one request at a time on the same weights, measured in the
same run.

    python benchmarks/engine_throughput.py [--threads 1] [--max-tokens 64] [--device cuda]

The engine is the torch backend itself (add, then step until every request finished), with
its default settings and the default random model; the time includes prefill. Both sides
decode greedily and always produce ``--max-tokens`` tokens (the default model has no EOS).

Ratios are what to compare: absolute figures move with the machine and its load. Each
figure is the best of ``--repeats`` rounds, and the rounds interleave baseline and engine, so
a burst of load from elsewhere on the machine hits both sides alike. Besides wall-clock
tokens/s it prints tokens per CPU-second of this process: on a shared machine that figure
does not count time spent waiting for a core (with one thread it is the steadier one; with
more, idle threads spinning in OpenMP count too).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engines.backend import GenerationRequest
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.weights import random_weights
from service.ops.settings import Settings


@dataclass
class Rate:
    """Best tokens per wall-clock second and per CPU-second seen so far."""

    wall: float = 0.0
    cpu: float = 0.0

    def keep_best(self, tokens: int, started: tuple[float, float]) -> None:
        wall, cpu = started
        self.wall = max(self.wall, tokens / (time.perf_counter() - wall))
        self.cpu = max(self.cpu, tokens / (time.process_time() - cpu))


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def prompts(count: int, length: int) -> list[str]:
    base = "the engine batches requests, the baseline runs them one by one "
    return [(f"request {i}: " + base * 4)[:length] for i in range(count)]


async def run_engine(backend: TorchBackend, concurrency: int, prompt_len: int, max_tokens: int) -> int:
    for i, prompt in enumerate(prompts(concurrency, prompt_len)):
        backend.add(GenerationRequest(f"c{concurrency}-{i}", prompt, max_tokens=max_tokens, temperature=0.0))
    generated = 0
    while backend.has_work():
        generated += sum(len(output.new_tokens) for output in await backend.step())
    if generated != concurrency * max_tokens:
        raise RuntimeError(f"the engine generated {generated} tokens, expected {concurrency * max_tokens}")
    return generated


def reference_model(backend: TorchBackend, seed: int) -> Any:
    """transformers' LlamaForCausalLM with the engine's weights, device and dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**backend.config.to_hf()))
    model.load_state_dict(random_weights(backend.config, seed))
    return model.to(device=backend.device, dtype=backend.dtype).eval()


def run_baseline(backend: TorchBackend, model: Any, requests: int, prompt_len: int, max_tokens: int) -> int:
    """The same prompts through ``generate``, one request at a time."""
    generated = 0
    with torch.inference_mode():
        for prompt in prompts(requests, prompt_len):
            ids = torch.tensor([backend.tokenizer.encode(prompt)], device=backend.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            generated += out.shape[1] - ids.shape[1]
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    return generated


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
    reference = reference_model(backend, settings.model_seed)

    params = sum(p.numel() for p in backend.model.parameters()) / 1e6
    print(f"default model: {params:.1f} M parameters, {backend.dtype} on {backend.device}, {torch.get_num_threads()} threads; "
          f"prompts of {args.prompt_len} tokens, {args.max_tokens} generated tokens per request, greedy; "
          f"best of {args.repeats} rounds")
    await run_engine(backend, 4, args.prompt_len, 8)  # warm-up
    run_baseline(backend, reference, 1, args.prompt_len, 8)
    baseline = Rate()
    engine = {concurrency: Rate() for concurrency in args.concurrency}
    for _ in range(args.repeats):
        started = clocks()
        baseline.keep_best(run_baseline(backend, reference, args.baseline_requests, args.prompt_len, args.max_tokens), started)
        for concurrency, rate in engine.items():
            started = clocks()
            rate.keep_best(await run_engine(backend, concurrency, args.prompt_len, args.max_tokens), started)

    print(f"{'':44} {'tokens/s':>10} {'ratio':>7}   {'tokens/CPU-s':>12} {'ratio':>7}")
    print(f"{'baseline: transformers generate, one at a time':44} {baseline.wall:10.0f} {'':>7}   {baseline.cpu:12.0f}")
    for concurrency, rate in engine.items():
        print(f"{f'engine, {concurrency} concurrent requests':44} {rate.wall:10.0f} {rate.wall / baseline.wall:6.1f}x"
              f"   {rate.cpu:12.0f} {rate.cpu / baseline.cpu:6.1f}x")


if __name__ == "__main__":
    asyncio.run(main())
