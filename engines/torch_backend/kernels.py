"""The model's swappable pieces: eager PyTorch, or fused versions on CUDA.

:class:`Kernels` names the element-wise pieces of a decoder layer (RMSNorm, the rotary
rotation, SwiGLU), the decode attention and a mixture-of-experts layer's experts. ``EAGER``
is plain PyTorch and is what the CPU always runs. On CUDA, :func:`cuda_kernels` compiles the
element-wise pieces with ``torch.compile`` (each becomes one generated kernel instead of
several small ones: a bf16 RMSNorm alone is four), reads KV pages in place with the Triton
decode kernel of :mod:`engines.torch_backend.paged_attention` and runs the experts as
grouped matrix products (:mod:`engines.torch_backend.experts`). The compiled functions are
built once per process and shared by every model in it; shapes are dynamic, so prefill
lengths and decode batch buckets reuse one compilation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engines.torch_backend.experts import Experts, grouped_experts, loop_experts


class PagedDecode(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        window: int = 0,
        /,
    ) -> torch.Tensor:
        """Attention of one query per sequence over its pages; ``window`` > 0 reads only the
        last ``window`` keys of each (a sliding window)."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # In float32 then back, as transformers does, so bf16 models round the same way.
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def rotate_(qk: torch.Tensor, rotary: torch.Tensor) -> None:
    """Rotate queries and keys ``[T, heads, head_dim]`` in place by ``rotary`` ``[T, 2, head_dim]``
    (cos, sign-folded sin): ``x * cos + swap_halves(x) * sin``."""
    half = qk.shape[-1] // 2
    swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    qk.copy_(torch.addcmul(qk * rotary[:, 0:1], swapped, rotary[:, 1:2]))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(gate) * up`` of the fused ``[T, 2 * intermediate]`` projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True, slots=True)
class Kernels:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotate_: Callable[[torch.Tensor, torch.Tensor], None]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    paged_decode: PagedDecode | None  # None: decode gathers each sequence's pages, then attends
    moe_experts: Experts = loop_experts  # the loop syncs with the host: no CUDA graph around it

    def describe(self) -> str:
        fused = "torch.compile" if self.rms_norm is not rms_norm else "eager"
        attention = "Triton paged decode" if self.paged_decode is not None else "gathered pages"
        experts = ", grouped-GEMM experts" if self.moe_experts is grouped_experts else ""
        return f"{fused} element-wise ops, {attention} attention{experts}"


EAGER = Kernels(rms_norm, rotate_, silu_mul, None)


@functools.cache
def compiled_pointwise(
    backend: str = "inductor",
) -> tuple[Callable[..., torch.Tensor], Callable[..., None], Callable[..., torch.Tensor]]:
    """The element-wise pieces through ``torch.compile``, once per process and backend.
    ``backend`` other than inductor is for tests: ``aot_eager`` traces the same graphs on CPU."""

    def compile_one(fn: Callable[..., object]) -> Callable[..., object]:
        return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)

    return compile_one(rms_norm), compile_one(rotate_), compile_one(silu_mul)  # type: ignore[return-value]


def cuda_kernels(compile_pointwise: bool, paged_attention: bool, moe: bool = False) -> Kernels:
    """``moe``: the model has experts, which then run grouped (the loop otherwise, unused)."""
    norm, rotate, swiglu = compiled_pointwise() if compile_pointwise else (rms_norm, rotate_, silu_mul)
    decode: PagedDecode | None = None
    if paged_attention:
        from engines.torch_backend.paged_attention import paged_decode

        decode = paged_decode
    return Kernels(norm, rotate, swiglu, decode, grouped_experts if moe else loop_experts)
