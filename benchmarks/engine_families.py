"""Tokens per second of the torch engine for each model family against transformers'
``generate`` on the same checkpoint, as ratios measured in one run (``engine_throughput.py
--family``).

Each family is measured on a random checkpoint of its released model's shape
(:data:`benchmarks.model_shapes.FAMILY_SHAPES`: Qwen2.5-1.5B, Qwen3-1.7B, Mistral-7B,
Qwen3-30B-A3B, Llama-3.2-1B) with ``--layers`` of its layers (vocabulary, widths, heads and
experts kept), written once and reused. One family at a time: transformers' model (its own
``from_pretrained`` of the checkpoint) and the engine are built, warmed up, then measured in
interleaved rounds, baseline then engine at each concurrency, each figure the best round;
both are freed before the next family. Ratios are what to compare across families: on a
model cut to a few layers the output layer (a vocabulary of 152 k for Qwen) weighs more than
in the full model, on both sides alike.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.engine_workloads import generate_one_at_a_time, greedy_requests, run_engine, text_prompts
from benchmarks.model_shapes import FAMILY_SHAPES, checkpoint, shape_config
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.setup import resolve_device, resolve_dtype


@dataclass
class FamilyRow:
    family: str
    shape: str
    parameters: float  # millions
    path: str
    baseline: float = 0.0  # tokens/s, best round
    engine: dict[int, float] = field(default_factory=dict)  # concurrency -> tokens/s, best round


async def measure_family(args: argparse.Namespace, family: str) -> FamilyRow:
    from transformers import AutoModelForCausalLM

    device = resolve_device(args.device)
    shape = FAMILY_SHAPES[family]
    config = shape_config(shape, args.layers)
    assert config is not None, "every family's shape has a checkpoint"
    dtype = resolve_dtype(args.dtype, config, device)
    model_dir = checkpoint(shape, args.checkpoint_dir, dtype, device, args.layers)
    reference: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    reference = reference.to(device).eval()
    backend = TorchBackend(
        TorchOptions(
            device=args.device,
            dtype=args.dtype,
            cpu_threads=args.threads,
            max_batch=max(args.concurrency),
            max_context=args.max_context,
        ),
        str(model_dir),
    )
    parameters = sum(parameter.numel() for parameter in backend.model.parameters()) / 1e6
    row = FamilyRow(family, f"{shape}, {config.num_layers} layers", parameters, backend.execution_path().describe())
    try:
        generate_one_at_a_time(reference, backend, text_prompts(1, args.prompt_len), 4)
        await run_engine(backend, greedy_requests(f"{family}-warm", text_prompts(2, args.prompt_len), 4))
        for _ in range(args.repeats):
            tokens, wall, _ = generate_one_at_a_time(
                reference, backend, text_prompts(args.baseline_requests, args.prompt_len), args.max_tokens
            )
            row.baseline = max(row.baseline, tokens / wall)
            for concurrency in args.concurrency:
                prompts = text_prompts(concurrency, args.prompt_len)
                run = await run_engine(backend, greedy_requests(f"{family}-{concurrency}", prompts, args.max_tokens))
                row.engine[concurrency] = max(row.engine.get(concurrency, 0.0), run.rate)
    finally:
        del reference, backend
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def print_rows(rows: list[FamilyRow], concurrency: list[int]) -> None:
    header = "".join(f"{f'engine x{c}':>12} {'ratio':>7}" for c in concurrency)
    print(f"{'family':10} {'shape':28} {'M params':>9} {'transformers':>13}{header}   path")
    for row in rows:
        cells = "".join(f"{row.engine[c]:12.1f} {row.engine[c] / row.baseline:6.2f}x" for c in concurrency)
        print(f"{row.family:10} {row.shape:28} {row.parameters:9.0f} {row.baseline:13.1f}{cells}   {row.path}")


async def family_table(args: argparse.Namespace) -> None:
    print(
        f"tokens/s per family: prompts of {args.prompt_len} tokens, {args.max_tokens} generated per request, greedy; "
        f"transformers generate one request at a time ({args.baseline_requests} requests); "
        f"the engine with each concurrency; best of {args.repeats} rounds"
    )
    rows = []
    for family in args.family:
        rows.append(await measure_family(args, family))
        print_rows(rows[-1:], args.concurrency)
    print()
    print_rows(rows, args.concurrency)
