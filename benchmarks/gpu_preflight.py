"""The GPU session's first step: build the engine once, say where the load went and which path
runs, stop unless it is the fast one; then the GPU time of each graph replay beside the
decode step's wall time.

    python -u benchmarks/gpu_preflight.py [--shape llama-1b] [--allow-slow-path]

Rows, each printed as soon as it exists:

- the load's phases (writing the random checkpoint, weights, kernel checks, activation peak
  and cache, graph capture) in seconds, and the execution path; exit status 3 if the path
  is not the fast one (``require_fast_path``), unless ``--allow-slow-path``;
- per graph bucket, the GPU time of one replay (CUDA events around it, median of
  ``--replays``; the static buffers' padding rows, so every row reads a one-token context);
- at batch 1 and at ``--max-batch`` concurrent requests of ``--prompt-len`` tokens: the
  decode step's wall time (p50) beside the GPU time of its replays (CUDA events, p50), whose
  difference is what the host adds to a step.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_workloads import greedy_requests, run_engine
from benchmarks.model_shapes import SHAPES, checkpoint
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.cuda_graphs import DecodeGraphs, GraphInputs
from engines.torch_backend.fast_path import FastPathUnavailable
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.setup import resolve_device, resolve_dtype

NOT_FAST = 3


class ReplayTimer:
    """Benchmark instrumentation: replaces a ``DecodeGraphs``' ``replay`` on that one object by
    itself, which records CUDA events around each replay; ``gpu_ms`` reads them afterwards, so
    the steps are not synchronised by the timing."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self._replay = graphs.replay
        self._events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        # The instance attribute shadows the method; mypy refuses a plain assignment to a method.
        setattr(graphs, "replay", self)  # noqa: B010

    def __call__(
        self, inputs: GraphInputs, previous: torch.Tensor | None = None, sources: list[int] | None = None
    ) -> torch.Tensor:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = self._replay(inputs, previous, sources)
        end.record()
        self._events.append((inputs.size, start, end))
        return logits

    def take(self) -> list[float]:
        """Milliseconds of each replay since the last call."""
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for _, start, end in self._events]
        self._events.clear()
        return times


def bucket_times(graphs: DecodeGraphs, replays: int) -> None:
    """The GPU time of one replay of each bucket's graph as captured (padding rows only)."""
    for size in graphs.buckets:
        inputs = GraphInputs.of([], size, graphs.block_size, graphs.scratch_page)
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.replay(inputs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        print(
            f"replay bucket {size:4d}: GPU {statistics.median(times):8.3f} ms (CUDA events, p50 of {replays})",
            flush=True,
        )


async def step_rows(backend: TorchBackend, timer: ReplayTimer | None, args: argparse.Namespace, path: str) -> None:
    vocab = min(backend.config.vocab_size, 32000)
    for batch in sorted({1, args.max_batch}):
        prompts = [[(97 * i + 13 * k) % vocab for k in range(args.prompt_len)] for i in range(batch)]
        await run_engine(backend, greedy_requests(f"warm{batch}", prompts[: min(4, batch)], 4))
        if timer is not None:
            timer.take()
        run = await run_engine(backend, greedy_requests(f"b{batch}", prompts, args.max_tokens))
        gpu = statistics.median(timer.take()) if timer is not None else float("nan")
        print(
            f"batch {batch:4d}: decode step wall p50 {run.decode_step_ms:8.3f} ms, replay GPU p50 {gpu:8.3f} ms, "
            f"host adds {run.decode_step_ms - gpu:8.3f} ms; {run.rate:9.0f} tokens/s; CPU {run.cpu_ms_per_step:.3f} ms/step; "
            f"path {path}",
            flush=True,
        )


async def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = resolve_device(args.device)
    shape = SHAPES[args.shape]
    config = shape or ModelConfig()
    started = time.perf_counter()
    model_dir = (
        None
        if shape is None
        else checkpoint(args.shape, args.checkpoint_dir, resolve_dtype("auto", config, device), device)
    )
    print(f"load: random {args.shape} checkpoint {time.perf_counter() - started:.2f} s", flush=True)
    try:
        backend = TorchBackend(
            TorchOptions(
                device=args.device,
                max_batch=args.max_batch,
                max_context=args.max_context if model_dir else None,
                kv_cache_gb=args.kv_cache_gb,
                require_fast_path=not args.allow_slow_path,
            ),
            str(model_dir) if model_dir else None,
        )
    except FastPathUnavailable as exc:
        print(f"path: NOT the fast path, stopping: {exc}", flush=True)
        return NOT_FAST
    path = backend.execution_path().describe()
    print(f"load: {backend.load_phases.describe()}", flush=True)
    print(f"path: {path}", flush=True)
    graphs = backend.graphs
    if graphs is not None:
        bucket_times(graphs, args.replays)
    await step_rows(backend, ReplayTimer(graphs) if graphs is not None else None, args, path)
    await backend.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--checkpoint-dir", type=Path, default=Path(tempfile.gettempdir()) / "dpcoord-bench-models")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--kv-cache-gb", type=float, default=16.0)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20, help="replays timed per bucket")
    parser.add_argument("--allow-slow-path", action="store_true", help="go on when a fast-path piece is off")
    return parser


if __name__ == "__main__":
    sys.exit(asyncio.run(main(build_parser().parse_args())))
