"""Choosing the device, the dtype and, on CUDA, the kernels the model runs.

The CUDA kernels (Triton paged decode, ``torch.compile`` element-wise pieces) need Triton and a
C compiler at run time. They are built and checked against eager PyTorch on small inputs when
the engine loads; if they cannot be built or disagree, the engine logs why and runs eager
PyTorch (without CUDA graphs, which need the paged kernel) rather than not starting.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

from engines.torch_backend.config import ModelConfig
from engines.torch_backend.kernels import EAGER, Kernels, cuda_kernels
from engines.torch_backend.model import LlamaModel

log = logging.getLogger(__name__)

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


def cuda_kernels_or_eager(model: LlamaModel, rotary: torch.Tensor, compile_pointwise: bool) -> Kernels:
    paged = importlib.util.find_spec("triton") is not None
    if not paged:
        log.warning("Triton is not installed: decode attention gathers pages, and decode runs without CUDA graphs")
    kernels = cuda_kernels(compile_pointwise, paged)
    try:
        check_kernels(kernels, model.config, rotary)
    except Exception as exc:  # a missing compiler, an unsupported GPU: the engine still serves, slower
        log.warning(
            "the CUDA kernels failed their check (%s: %s): running eager PyTorch without CUDA graphs",
            type(exc).__name__,
            exc,
        )
        return EAGER
    return kernels


def check_kernels(kernels: Kernels, config: ModelConfig, rotary: torch.Tensor) -> None:
    """Each of ``kernels`` against eager PyTorch on random inputs of the model's shapes
    (building them compiles them); raises AssertionError when one disagrees."""
    device, dtype = rotary.device, rotary.dtype
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    tokens, heads, kv_heads, head_dim = 5, config.num_heads, config.num_kv_heads, config.head_dim
    hidden, weight = randn(tokens, config.hidden_size), randn(config.hidden_size)
    torch.testing.assert_close(
        kernels.rms_norm(hidden, weight, config.rms_norm_eps),
        EAGER.rms_norm(hidden, weight, config.rms_norm_eps),
        atol=tolerance,
        rtol=tolerance,
    )
    qk, table = (
        randn(tokens, heads + kv_heads, head_dim),
        rotary[torch.arange(tokens, device=device) * 7 % rotary.shape[0]],
    )
    expected = qk.clone()
    EAGER.rotate_(expected, table)
    kernels.rotate_(qk, table)
    torch.testing.assert_close(qk, expected, atol=tolerance, rtol=tolerance)
    gate_up = randn(tokens, 2 * config.intermediate_size)
    torch.testing.assert_close(kernels.silu_mul(gate_up), EAGER.silu_mul(gate_up), atol=tolerance, rtol=tolerance)
    if kernels.paged_decode is None:
        return
    block_size, pages, lengths = 4, 6, [5, 1, 12]
    cache = randn(pages + 1, block_size, 2, kv_heads, head_dim)
    tables = torch.tensor([[5, 0, 0], [2, 0, 0], [1, 3, 4]], dtype=torch.int32, device=device)
    query = randn(len(lengths), heads, head_dim)
    out = kernels.paged_decode(query, cache, tables, torch.tensor(lengths, dtype=torch.int32, device=device))
    for row, length in enumerate(lengths):
        slots = [
            int(tables[row, position // block_size]) * block_size + position % block_size for position in range(length)
        ]
        kv = cache.view(-1, 2, kv_heads, head_dim)[slots].transpose(0, 2)  # [kv_heads, 2, L, head_dim]
        folded = query[row].view(kv_heads, heads // kv_heads, head_dim)
        reference = F.scaled_dot_product_attention(folded, kv[:, 0], kv[:, 1]).reshape(heads, head_dim)
        torch.testing.assert_close(out[row], reference, atol=tolerance, rtol=tolerance)
