"""Generated tokens per second of the torch engine with 1, 8, 32 and 128 concurrent requests,
against transformers' ``generate`` one request at a time on the same weights, measured in the
same run; with ``--full``, also the figures of a GPU session.

    python benchmarks/engine_throughput.py [--threads 1] [--max-tokens 64] [--device cuda]
    python benchmarks/engine_throughput.py --device cuda --shape llama-1b --full \\
        --concurrency 1 256 --prompt-len 128 --max-tokens 128
    python benchmarks/engine_throughput.py --family qwen2 qwen3 mistral qwen3_moe --layers 1

The engine is the torch backend itself (add, then step until every request finished), with
its default settings; the time includes prefill. ``--shape`` picks the model: the engine's
default random model, or a random checkpoint of a real model's shape written on the fly
(``benchmarks/model_shapes.py``: ``llama-1b``, ``llama-8b``, ``qwen2.5-1.5b``, ``qwen3-1.7b``,
``mistral-7b``, ``qwen3-30b-a3b``, and ``tiny`` to try the script on a CPU), with ``--layers``
of its layers if given. ``--family`` instead measures each family named on its released
model's shape (``benchmarks/engine_families.py``), one table with a row per family. Both
sides decode greedily and always produce ``--max-tokens`` tokens (no EOS).

Ratios are what to compare: absolute figures move with the machine and its load. Each
figure is the best of ``--repeats`` rounds, and the rounds interleave baseline and engine, so
a burst of load from elsewhere on the machine hits both sides alike. Besides wall-clock
tokens/s it prints tokens per CPU-second of this process: on a shared machine that figure
does not count time spent waiting for a core (with one thread it is the steadier one; with
more, idle threads spinning in OpenMP count too).

``--full`` adds, for the largest concurrency: the decode step's median time and the engine's
CPU per step; the memory-bandwidth floor of a step (the weights' bytes over a measured on-device
copy rate, and over the vendor's figure where the GPU is known); transformers ``generate`` as
one static batch of that size; and the shared-prefix workload (``--prefix-requests`` requests
sharing a ``--prefix-tokens`` system prompt, each with ``--own-tokens`` of its own) with prefix
caching on and off: time to first token and tokens/s.

``--logprobs K`` adds, for each concurrency, the same requests asking for each token's
log-probability and its K most likely alternatives, run beside them in every round: tokens/s,
the decode step's median and the engine's CPU per step, against the requests without.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_families import family_table
from benchmarks.engine_workloads import (
    EngineRun,
    copy_bandwidth,
    generate_one_at_a_time,
    generate_static_batch,
    greedy_requests,
    nominal_bandwidth,
    run_engine,
    shared_prefix_prompts,
    text_prompts,
)
from benchmarks.model_shapes import SHAPES, checkpoint, shape_config, weight_bytes
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families import SUPPORTED, hf_config
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.setup import resolve_device, resolve_dtype
from engines.torch_backend.weights import random_weights


@dataclass
class Rate:
    """Best tokens per wall-clock second and per CPU-second seen so far."""

    wall: float = 0.0
    cpu: float = 0.0

    def keep_best(self, tokens: int, wall: float, cpu: float) -> None:
        self.wall = max(self.wall, tokens / wall)
        self.cpu = max(self.cpu, tokens / cpu)


def build_backend(
    args: argparse.Namespace, model_dir: Path | None, max_batch: int, prefix_caching: bool | None = None
) -> TorchBackend:
    return TorchBackend(
        TorchOptions(
            device=args.device,
            dtype=args.dtype,
            cpu_threads=args.threads,
            max_batch=max_batch,
            max_context=args.max_context if model_dir else None,
            prefix_caching=not args.no_prefix_caching if prefix_caching is None else prefix_caching,
            cuda_graphs=not args.no_cuda_graphs,
            torch_compile=not args.no_torch_compile,
            require_fast_path=args.require_fast_path,
        ),
        str(model_dir) if model_dir else None,
    )


def path_label(backend: TorchBackend) -> str:
    """The path a row ran, for the row itself: a fallback must show where the figure is."""
    return backend.execution_path().describe()


def reference_model(config: ModelConfig, model_dir: Path | None, dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' causal LM of the family with the engine's weights, device and dtype; built
    before the engine, so that the engine sizes its KV cache from the memory left."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model: Any
    if model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config(config)))
        model.load_state_dict(random_weights(config, TorchOptions().model_seed))
    return model.to(device=device, dtype=dtype).eval()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt length in bytes (= tokens)")
    parser.add_argument(
        "--baseline-requests", type=int, default=8, help="requests run through transformers, one at a time"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads, the engine's cpu_threads setting (default: torch's choice)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--shape", default="default", choices=sorted(SHAPES), help="the model: see benchmarks/model_shapes.py"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="keep this many of the shape's (or each family's) layers"
    )
    parser.add_argument(
        "--family",
        nargs="+",
        choices=SUPPORTED,
        help="one row per family, each on its released model's shape (benchmarks/engine_families.py)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "dpcoord-bench-models",
        help="where random checkpoints are written (and reused)",
    )
    parser.add_argument(
        "--max-context", type=int, default=2048, help="the engine's max_context for a --shape checkpoint"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the best round")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="the engine's cuda_graphs setting off")
    parser.add_argument("--no-torch-compile", action="store_true", help="the engine's torch_compile setting off")
    parser.add_argument(
        "--require-fast-path",
        action="store_true",
        help="the engine's require_fast_path setting: stop unless graphs, the paged kernel and compiled pieces are on",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="the engine's prefix_caching setting off (rounds repeat their prompts: later rounds hit the cache)",
    )
    parser.add_argument(
        "--full", action="store_true", help="also step times, the bandwidth floor, a static batch and the shared prefix"
    )
    parser.add_argument("--no-shared-prefix", action="store_true", help="with --full: leave out the shared-prefix rows")
    parser.add_argument(
        "--shared-prefix-only", action="store_true", help="only the shared-prefix rows (no transformers baseline)"
    )
    parser.add_argument("--prefix-requests", type=int, default=256)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--own-tokens", type=int, default=32)
    parser.add_argument(
        "--logprobs", type=int, default=None, metavar="K", help="also the requests asking for logprobs, K alternatives"
    )
    return parser.parse_args()


async def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.family:
        await family_table(args)
        return
    device = resolve_device(args.device)
    shape = shape_config(args.shape, args.layers)
    config = shape or ModelConfig()
    dtype = resolve_dtype(args.dtype, config, device)
    model_dir = None if shape is None else checkpoint(args.shape, args.checkpoint_dir, dtype, device, args.layers)
    if not args.shared_prefix_only:
        await throughput_table(args, config, model_dir, dtype, device)
        free_memory()
    if args.shared_prefix_only or (args.full and not args.no_shared_prefix):
        await shared_prefix_rows(args, config, model_dir)


async def throughput_table(
    args: argparse.Namespace, config: ModelConfig, model_dir: Path | None, dtype: torch.dtype, device: torch.device
) -> None:
    reference = reference_model(config, model_dir, dtype, device)
    backend = build_backend(args, model_dir, max(args.concurrency))
    params = sum(p.numel() for p in backend.model.parameters()) / 1e6
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"{args.shape} model: {params:.1f} M parameters, {backend.dtype} on {backend.device} ({where}); "
        f"{backend.kernels.describe()}; path {backend.execution_path().describe()}; "
        f"prompts of {args.prompt_len} tokens, {args.max_tokens} generated tokens per request, greedy; best of {args.repeats} rounds"
    )

    await run_engine(backend, greedy_requests("warm", text_prompts(4, args.prompt_len), 8))
    generate_one_at_a_time(reference, backend, text_prompts(1, args.prompt_len), 8)
    baseline = Rate()
    engine = {concurrency: Rate() for concurrency in args.concurrency}
    runs: dict[int, EngineRun] = {}
    with_logprobs: dict[int, EngineRun] = {}
    for _ in range(args.repeats):
        baseline.keep_best(
            *generate_one_at_a_time(
                reference, backend, text_prompts(args.baseline_requests, args.prompt_len), args.max_tokens
            )
        )
        for concurrency, rate in engine.items():
            run = await run_engine(
                backend, greedy_requests(f"c{concurrency}", text_prompts(concurrency, args.prompt_len), args.max_tokens)
            )
            rate.keep_best(run.generated, run.wall, run.cpu)
            if concurrency not in runs or run.rate > runs[concurrency].rate:
                runs[concurrency] = run
            if args.logprobs is not None:
                prompts = text_prompts(concurrency, args.prompt_len)
                asked = await run_engine(
                    backend, greedy_requests(f"l{concurrency}", prompts, args.max_tokens, args.logprobs)
                )
                if concurrency not in with_logprobs or asked.rate > with_logprobs[concurrency].rate:
                    with_logprobs[concurrency] = asked

    path = path_label(backend)
    print(f"{'':44} {'tokens/s':>10} {'ratio':>7}   {'tokens/CPU-s':>12} {'ratio':>7}   path")
    print(f"{'baseline: transformers generate, one at a time':44} {baseline.wall:10.0f} {'':>7}   {baseline.cpu:12.0f}")
    for concurrency, rate in engine.items():
        print(
            f"{f'engine, {concurrency} concurrent requests':44} {rate.wall:10.0f} {rate.wall / baseline.wall:6.1f}x"
            f"   {rate.cpu:12.0f} {rate.cpu / baseline.cpu:6.1f}x   {path}"
        )
    if with_logprobs:
        print(
            f"{f'with logprobs {args.logprobs} (best round)':44} {'tokens/s':>10} {'step p50 ms':>12} {'CPU ms/step':>12}"
        )
        for concurrency, asked in with_logprobs.items():
            plain = runs[concurrency]
            print(
                f"{f'  {concurrency}: without / with / ratio':44} {plain.rate:10.0f} {plain.decode_step_ms:12.3f} "
                f"{plain.cpu_ms_per_step:12.3f}\n{'':44} {asked.rate:10.0f} {asked.decode_step_ms:12.3f} "
                f"{asked.cpu_ms_per_step:12.3f}\n{'':44} {asked.rate / plain.rate:9.2f}x "
                f"{asked.decode_step_ms / plain.decode_step_ms:11.2f}x {asked.cpu_ms_per_step / plain.cpu_ms_per_step:11.2f}x   {path}"
            )
    if not args.full:
        await backend.close()
        return

    print()
    print(
        f"{'engine, concurrent requests (best round)':44} {'step p50 ms':>12} {'CPU ms/step':>12} {'TTFT p50 ms':>12}   path"
    )
    for concurrency, run in runs.items():
        print(
            f"{f'  {concurrency}':44} {run.decode_step_ms:12.3f} {run.cpu_ms_per_step:12.3f} {run.ttft_ms:12.1f}   {path}"
        )
    weights = weight_bytes(backend.model)
    measured = copy_bandwidth(backend.device)
    print(
        f"bandwidth floor of a decode step: {weights / 1e9:.2f} GB of weights / {measured / 1e12:.2f} TB/s measured copy rate "
        f"= {1000 * weights / measured:.3f} ms"
    )
    nominal = nominal_bandwidth(backend.device)
    if nominal is not None:
        print(f"  at the {nominal[0]}'s stated {nominal[1] / 1e12:.2f} TB/s: {1000 * weights / nominal[1]:.3f} ms")
    largest = max(runs)
    tokens, wall, _ = generate_static_batch(reference, backend, text_prompts(largest, args.prompt_len), args.max_tokens)
    print(
        f"transformers generate, static batch of {largest}: {tokens / wall:.0f} tokens/s; "
        f"the engine at {largest} concurrent: {runs[largest].rate:.0f} tokens/s ({runs[largest].rate * wall / tokens:.2f}x) [{path}]"
    )
    await backend.close()


async def shared_prefix_rows(args: argparse.Namespace, config: ModelConfig, model_dir: Path | None) -> None:
    """The shared-prefix workload, each setting on a fresh engine: a warm-up with another system
    prompt, then the measured run, whose system prompt is computed once (cache on) or by every request."""
    results: dict[bool, tuple[EngineRun, float]] = {}
    paths: dict[bool, str] = {}
    for caching in (True, False):
        engine = build_backend(args, model_dir, args.prefix_requests, prefix_caching=caching)
        warm = shared_prefix_prompts(
            min(8, args.prefix_requests), args.prefix_tokens, args.own_tokens, config.vocab_size, seed=1
        )
        await run_engine(engine, greedy_requests("prefix-warm", warm, 8))
        before = engine.prefix_cache_stats()
        prompts = shared_prefix_prompts(
            args.prefix_requests, args.prefix_tokens, args.own_tokens, config.vocab_size, seed=2
        )
        run = await run_engine(engine, greedy_requests(f"prefix-{caching}", prompts, args.max_tokens))
        after = engine.prefix_cache_stats()
        queried = after.queried_tokens - before.queried_tokens
        results[caching] = run, (after.hit_tokens - before.hit_tokens) / queried if queried else 0.0
        paths[caching] = path_label(engine)
        await engine.close()
        del engine
        free_memory()
    (on, on_hits), (off, off_hits) = results[True], results[False]
    print(
        f"shared prefix: {args.prefix_requests} requests, a {args.prefix_tokens}-token system prompt + {args.own_tokens} "
        f"tokens of their own, {args.max_tokens} generated"
    )
    print(f"{'':44} {'TTFT p50 ms':>12} {'tokens/s':>10} {'hit rate':>9}   path")
    for label, run, hits, caching in (
        ("prefix caching on", on, on_hits, True),
        ("prefix caching off", off, off_hits, False),
    ):
        print(f"{f'  {label}':44} {run.ttft_ms:12.1f} {run.rate:10.0f} {hits:9.3f}   {paths[caching]}")
    print(f"{'  on / off':44} {on.ttft_ms / off.ttft_ms:11.2f}x {on.rate / off.rate:9.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
