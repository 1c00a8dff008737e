"""Choosing the device, the dtype and, on CUDA, the kernels the model runs.

The CUDA kernels (Triton paged decode, ``torch.compile`` element-wise pieces) need Triton and a
C compiler at run time. They are built and checked against eager PyTorch on small inputs when
the engine loads; a piece that cannot be built or disagrees is logged with its traceback, named
in the engine's :class:`~engines.backend.ExecutionPath` and replaced by eager PyTorch (without
CUDA graphs, if it is the paged kernel they need), unless ``require_fast_path`` refuses that.
A mixture-of-experts model's grouped experts are checked against the per-expert loop; if they
fail, the failure reads "MoE runs eager": the loop then runs, and decode without CUDA graphs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F

from engines.torch_backend.config import ModelConfig
from engines.torch_backend.experts import loop_experts
from engines.torch_backend.kernels import EAGER, Kernels, cuda_kernels
from engines.torch_backend.model import DecoderModel

log = logging.getLogger(__name__)

MOE_EAGER = "MoE runs eager"  # the failure named when the grouped experts do not build

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``--dtype`` wins, then the checkpoint's dtype, then bf16 on CUDA and float32 on CPU."""
    if name != "auto":
        return _DTYPES[name]
    if config.dtype is not None:
        return _DTYPES[config.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def checked_cuda_kernels(
    model: DecoderModel, rotary: torch.Tensor, compile_pointwise: bool
) -> tuple[Kernels, list[str]]:
    """The CUDA kernels that passed their check, and the pieces that failed (each logged with its
    traceback). A failed piece falls back alone: compiled element-wise pieces that fail leave the
    paged kernel on, and the other way round."""
    failures: list[str] = []
    paged = importlib.util.find_spec("triton") is not None
    if not paged:
        log.warning("Triton is not installed: decode attention gathers pages, and decode runs without CUDA graphs")
        failures.append("paged kernel")
    kernels = cuda_kernels(compile_pointwise, paged, moe=model.config.moe is not None)
    if compile_pointwise:
        try:
            check_pointwise(kernels, model.config, rotary)
        except Exception:  # a missing compiler, an unsupported GPU: the engine still serves, slower
            log.exception("the compiled element-wise pieces failed their check: they run eagerly")
            failures.append("compiled pieces")
            kernels = replace(kernels, rms_norm=EAGER.rms_norm, rotate_=EAGER.rotate_, silu_mul=EAGER.silu_mul)
    if kernels.paged_decode is not None:
        try:
            check_paged_decode(kernels, model.config, rotary)
        except Exception:
            log.exception("the Triton paged decode kernel failed its check: decode gathers pages, without CUDA graphs")
            failures.append("paged kernel")
            kernels = replace(kernels, paged_decode=None)
    if model.config.moe is not None:
        try:
            check_experts(kernels, model.config, rotary)
        except Exception:
            log.exception("the grouped MoE experts failed their check: MoE runs eager, decode without CUDA graphs")
            failures.append(MOE_EAGER)
            kernels = replace(kernels, moe_experts=loop_experts)
    return kernels, failures


def check_kernels(kernels: Kernels, config: ModelConfig, rotary: torch.Tensor) -> None:
    """Each of ``kernels`` against eager PyTorch on random inputs of the model's shapes
    (building them compiles them); raises AssertionError when one disagrees."""
    check_pointwise(kernels, config, rotary)
    check_paged_decode(kernels, config, rotary)
    if config.moe is not None:
        check_experts(kernels, config, rotary)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def _randn(generator: torch.Generator, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=generator.device).to(dtype)

    return randn


def check_pointwise(kernels: Kernels, config: ModelConfig, rotary: torch.Tensor) -> None:
    """The element-wise pieces against eager, in the variants serving runs and no other: under
    ``inference_mode``, with several tokens (prefill) and with one (decode at batch 1; dynamo
    specialises a size of 1), on inputs laid out as the model lays them out (rotary gets a view
    of the fused q|k|v rows). Compiling them here means serving never recompiles, so a process
    holds two variants of each piece per dtype, well inside dynamo's recompile limit of 8."""
    device, dtype = rotary.device, rotary.dtype
    tolerance = _tolerance(dtype)
    randn = _randn(torch.Generator(device=device).manual_seed(0), dtype)
    # A parameter made outside inference mode, as the model's norm weights are: dynamo guards on
    # the type and on the dispatch keys, which differ for tensors made in inference mode.
    weight = torch.nn.Parameter(randn(config.hidden_size), requires_grad=False)
    head_weight = torch.nn.Parameter(randn(config.head_dim), requires_grad=False)
    with torch.inference_mode():
        _check_pointwise(kernels, config, rotary, (weight, head_weight), randn, tolerance)


def _check_pointwise(
    kernels: Kernels,
    config: ModelConfig,
    rotary: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    randn: Callable[..., torch.Tensor],
    tolerance: float,
) -> None:
    device = rotary.device
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    weight, head_weight = weights

    def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
        torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)

    widths = [config.intermediate_size] + ([config.moe.intermediate_size] if config.moe is not None else [])
    for tokens in (5, 1):
        hidden = randn(tokens, config.hidden_size)
        close(
            kernels.rms_norm(hidden, weight, config.rms_norm_eps), EAGER.rms_norm(hidden, weight, config.rms_norm_eps)
        )
        qkv = randn(tokens, heads + 2 * kv_heads, head_dim)
        if config.qk_norm:  # per head, on views of the fused rows, as the model calls it
            for rows in (qkv[:, :heads], qkv[:, heads : heads + kv_heads]):
                eps = config.rms_norm_eps
                close(kernels.rms_norm(rows, head_weight, eps), EAGER.rms_norm(rows, head_weight, eps))
        table = rotary[torch.arange(tokens, device=device) * 7 % rotary.shape[0]]
        expected = qkv.clone()
        EAGER.rotate_(expected[:, : heads + kv_heads], table)
        kernels.rotate_(qkv[:, : heads + kv_heads], table)
        close(qkv, expected)
        for width in widths:
            gate_up = randn(tokens, 2 * width)
            close(kernels.silu_mul(gate_up), EAGER.silu_mul(gate_up))


@torch.inference_mode()
def check_paged_decode(kernels: Kernels, config: ModelConfig, rotary: torch.Tensor) -> None:
    """The paged decode kernel (if any) against gathered attention over a few pages."""
    if kernels.paged_decode is None:
        return
    device, dtype = rotary.device, rotary.dtype
    tolerance = _tolerance(dtype)
    randn = _randn(torch.Generator(device=device).manual_seed(1), dtype)
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    block_size, pages, lengths = 4, 6, [5, 1, 12]
    cache = randn(pages + 1, block_size, 2, kv_heads, head_dim)
    tables = torch.tensor([[5, 0, 0], [2, 0, 0], [1, 3, 4]], dtype=torch.int32, device=device)
    query = randn(len(lengths), heads, head_dim)
    # A model with a sliding window checks a window short enough to leave keys out.
    window = 0 if config.sliding_window is None else 3
    out = kernels.paged_decode(query, cache, tables, torch.tensor(lengths, dtype=torch.int32, device=device), window)
    for row, length in enumerate(lengths):
        first = max(length - window, 0) if window else 0
        slots = [
            int(tables[row, position // block_size]) * block_size + position % block_size
            for position in range(first, length)
        ]
        kv = cache.view(-1, 2, kv_heads, head_dim)[slots].transpose(0, 2)  # [kv_heads, 2, L, head_dim]
        folded = query[row].view(kv_heads, heads // kv_heads, head_dim)
        reference = F.scaled_dot_product_attention(folded, kv[:, 0], kv[:, 1]).reshape(heads, head_dim)
        torch.testing.assert_close(out[row], reference, atol=tolerance, rtol=tolerance)


@torch.inference_mode()
def check_experts(kernels: Kernels, config: ModelConfig, rotary: torch.Tensor) -> None:
    """The experts piece against the per-expert loop, on random routings of the model's shapes
    (several tokens, and one: a decode step at batch 1). On CUDA the piece must not sync with
    the host either (a CUDA graph could not hold it): torch's grouped GEMM falls back to a loop
    that reads the group offsets on the host where it has no kernel (float32, older GPUs)."""
    assert config.moe is not None, "only a mixture-of-experts model has experts to check"
    moe = config.moe
    device, dtype = rotary.device, rotary.dtype
    tolerance = _tolerance(dtype)
    generator = torch.Generator(device=device).manual_seed(2)
    randn = _randn(generator, dtype)
    # The experts' shapes, up to 16 of them (128 of Qwen3-30B-A3B's would take 1.2 GB here),
    # scaled so that every product is of order one: bf16 rounding stays inside the tolerance.
    count = min(moe.num_experts, 16)
    gate_up = randn(count, 2 * moe.intermediate_size, config.hidden_size) * config.hidden_size**-0.5
    down = randn(count, config.hidden_size, moe.intermediate_size) * moe.intermediate_size**-0.5
    for tokens in (5, 1):
        x = randn(tokens, config.hidden_size)
        scores = torch.rand((tokens, count), generator=generator, device=device)
        weights, experts = torch.topk(scores, min(moe.experts_per_token, count), dim=-1)
        args = (x, weights.to(dtype), experts, gate_up, down, kernels.silu_mul)
        with _no_host_sync(device):
            out = kernels.moe_experts(*args)
        torch.testing.assert_close(out, loop_experts(*args), atol=tolerance, rtol=tolerance)


@contextlib.contextmanager
def _no_host_sync(device: torch.device) -> Iterator[None]:
    """On CUDA, an operation that synchronises with the host raises inside this block."""
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)
