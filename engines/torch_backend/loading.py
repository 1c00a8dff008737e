"""Loading the torch backend's model: weights, tokenizer, checked kernels and the KV cache.

:func:`load_model` does, in order and timed per phase (:class:`LoadPhases`): read the
config and with it the model family (:mod:`engines.torch_backend.families`), then the
checkpoint (or build the seeded random model), check the CUDA kernels (each failing piece is
named in ``failures`` and replaced by its eager form), measure the activation peak and size the
KV cache from what memory is left, then allocate it. What it returns is everything the backend
serves with; graph capture, which needs the cache, is the backend's own next phase. Reading a
checkpoint is said as it goes (:class:`~service.ops.progress.Progress`: bytes of its
``*.safetensors`` read out of their total, a bar on a terminal, a log line every few seconds
otherwise), so a long load is never silent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.chat_template import ChatTemplate
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families import read_model_dir
from engines.torch_backend.fast_path import LoadPhases
from engines.torch_backend.memory import (
    CachePlan,
    activation_peak,
    allocate_cache,
    cache_shape,
    page_bytes,
    plan_cache,
)
from engines.torch_backend.model import DecoderModel
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.rope import rotary_table
from engines.torch_backend.setup import checked_cuda_kernels, resolve_dtype
from engines.torch_backend.tokenizer import Tokenizer, load_tokenizer
from engines.torch_backend.weights import build_model, checkpoint_weights, random_weights
from service.ops.progress import Progress

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    dtype: torch.dtype
    model: DecoderModel
    tokenizer: Tokenizer
    model_name: str  # for the log: the checkpoint's path, or the random model's seed
    default_model_name: str  # served unless --served-model-name says otherwise
    chat_template: ChatTemplate | None
    rotary: torch.Tensor
    failures: list[str]  # fast-path pieces that failed to build
    plan: CachePlan
    page_bytes: int
    max_context: int  # the model's context, bounded by what the KV cache holds
    cache_shape: tuple[int, ...]
    kv_cache: torch.Tensor


def _weights_progress(model_dir: Path | None) -> Progress:
    """The weights' loading, said as it goes: bytes of ``*.safetensors`` read out of theirs."""
    if model_dir is None:
        log.info("building the random default model")
        return Progress("building the random default model", None, log)
    files = sorted(model_dir.glob("*.safetensors"))
    total = sum(file.stat().st_size for file in files)
    log.info("loading weights from %s: %d files, %.2f GB", model_dir, len(files), total / 1e9)
    return Progress(f"loading weights from {model_dir.name}", total, log)


def _counted(weights: Iterator[tuple[str, torch.Tensor]], progress: Progress) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        progress.advance(tensor.numel() * tensor.element_size())
        yield name, tensor


def load_model(options: TorchOptions, model_path: str | None, device: torch.device, phases: LoadPhases) -> LoadedModel:
    model_dir = Path(model_path).expanduser() if model_path else None
    # The family is read (and an unsupported one refused) before any weight is.
    config = read_model_dir(model_dir) if model_dir else ModelConfig()
    dtype = resolve_dtype(options.dtype, config, device)
    progress = _weights_progress(model_dir)
    weights = checkpoint_weights(model_dir) if model_dir else iter(random_weights(config, options.model_seed).items())
    model = build_model(config, _counted(weights, progress), dtype, device)
    progress.done()
    tokenizer = load_tokenizer(model_dir)
    phases.done("weights")

    max_context = options.max_context or config.max_position_embeddings
    if max_context > config.max_position_embeddings:
        raise ValueError(
            f"max_context {max_context} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )
    block_size = options.kv_block_size
    rotary = rotary_table(config.rope, config.head_dim, max_context, dtype, device)
    failures: list[str] = []
    if device.type == "cuda":
        model.kernels, failures = checked_cuda_kernels(model, rotary, options.torch_compile)
    phases.done("kernel checks")
    peak = (
        activation_peak(model, rotary, min(options.max_prefill_tokens, max_context - 1), block_size)
        if device.type == "cuda"
        else 0
    )
    page = page_bytes(config, block_size, dtype)
    pages_per_sequence = -(-max_context // block_size)
    plan = plan_cache(
        device, page, options.max_batch * pages_per_sequence, options.kv_memory_fraction, options.kv_cache_gb, peak
    )
    held = min(max_context, plan.num_blocks * block_size)
    if held < max_context:
        log.warning("the KV cache holds %d tokens: requests are limited to that context, not %d", held, max_context)
    shape = cache_shape(config, plan.num_blocks, block_size)
    kv_cache = allocate_cache(shape, dtype, device)
    phases.done("activation peak and cache")
    return LoadedModel(
        config=config,
        dtype=dtype,
        model=model,
        tokenizer=tokenizer,
        model_name=str(model_dir) if model_dir else f"random default model (seed {options.model_seed})",
        default_model_name=(model_dir.resolve().name or str(model_dir)) if model_dir else "dpcoord-random",
        chat_template=ChatTemplate.from_dir(model_dir) if model_dir else None,
        rotary=rotary,
        failures=failures,
        plan=plan,
        page_bytes=page,
        max_context=held,
        cache_shape=shape,
        kv_cache=kv_cache,
    )
