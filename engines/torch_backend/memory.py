"""Sizing and allocating the KV cache from the memory actually free.

On CUDA the budget is what ``torch.cuda.mem_get_info`` reports free, less the share of the
device kept back (``1 - kv_memory_fraction``) and less the activation peak measured by a
warm-up pass; on CPU it is ``kv_memory_fraction`` of the memory the OS reports available.
``kv_cache_gb`` replaces the measured budget. The cache never takes more pages than
``max_batch`` sequences of ``max_context`` tokens can use. When the budget holds no page at
all, loading fails with the figures, not at the first request.

The cache tensor is ``[layers, pages + 1, block_size, 2, kv_heads, head_dim]``: the extra last
page is scratch, never handed out, for the padding rows of a CUDA graph replay to write to,
and the last token of a prompt read whole from the prefix cache (its own page is shared).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engines.torch_backend.batch import build_batch
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.model import DecoderModel
from engines.torch_backend.scheduler import ScheduledBatch
from engines.torch_backend.sequence import Sequence

GIB = 1 << 30


class KVCacheSizeError(RuntimeError):
    """The memory budget leaves no room for a single KV-cache page."""


def page_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page across all layers: keys and values of ``block_size`` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * block_size * 2 * config.num_kv_heads * config.head_dim * element


def host_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (Linux), else free physical pages; None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True, slots=True)
class CachePlan:
    num_blocks: int
    budget_bytes: int
    source: str  # where the budget came from, for the log line

    def describe(self, page: int) -> str:
        return f"{self.num_blocks} pages ({self.num_blocks * page / GIB:.3f} GiB) of a {self.budget_bytes / GIB:.3f} GiB budget ({self.source})"


def plan_cache(
    device: torch.device,
    page: int,
    max_pages_used: int,
    fraction: float,
    budget_gb: float | None,
    activation_peak_bytes: int = 0,
) -> CachePlan:
    if budget_gb is not None:
        budget, source = int(budget_gb * GIB), "kv_cache_gb"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1 - fraction) * total - activation_peak_bytes)
        source = (
            f"{free / GIB:.2f} GiB free of {total / GIB:.2f} GiB, {1 - fraction:.0%} kept back, "
            f"{activation_peak_bytes / GIB:.2f} GiB activation peak"
        )
    else:
        available = host_available_bytes()
        if available is None:
            budget, source = max_pages_used * page, "host memory unknown: sized for max_batch x max_context"
        else:
            budget, source = (
                int(available * fraction),
                f"{fraction:.0%} of {available / GIB:.2f} GiB available host memory",
            )
    num_blocks = min(max(budget, 0) // page, max_pages_used)
    if num_blocks < 1:
        raise KVCacheSizeError(
            f"the KV cache comes out empty: a page needs {page} bytes, the budget is {budget} bytes ({source}); "
            "free memory, raise --kv-memory-fraction or set --kv-cache-gb, or use a smaller --dtype"
        )
    return CachePlan(num_blocks, budget, source)


def cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The cache tensor's shape for ``num_blocks`` usable pages, plus the scratch page."""
    return (config.num_layers, num_blocks + 1, block_size, 2, config.num_kv_heads, config.head_dim)


def allocate_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Zeroed: padded page-table entries read some page, and a masked NaN would still poison the output.
    return torch.zeros(shape, dtype=dtype, device=device)


def activation_peak(model: DecoderModel, rotary: torch.Tensor, tokens: int, block_size: int) -> int:
    """CUDA: run the largest prefill once on a scratch cache; return its activation peak in bytes.
    It also compiles whatever the model's kernels compile for prefill shapes."""
    device, dtype = rotary.device, rotary.dtype
    config = model.config
    pages = -(-tokens // block_size)
    scratch = allocate_cache(cache_shape(config, pages - 1, block_size), dtype, device)
    sequence = Sequence.from_prompt("warm-up", [0] * tokens)
    sequence.block_table = list(range(pages))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        batch = build_batch(
            ScheduledBatch([], [sequence]),
            block_size,
            config.group_size,
            dtype,
            device,
            sliding_window=config.sliding_window,
        )
        model(batch, rotary, scratch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch
    torch.cuda.empty_cache()
    return peak
