"""The experts of a mixture-of-experts layer: every token's chosen experts applied and summed.

Both forms take the tokens ``x`` ``[T, hidden]``, each token's ``k`` chosen experts
``experts`` ``[T, k]`` (int64) and their weights ``weights`` ``[T, k]`` (the model's dtype),
and the stacked expert weights ``gate_up`` ``[E, 2 * I, hidden]`` (gate rows, then up rows)
and ``down`` ``[E, hidden, I]``; they return ``sum_j weights[t, j] * expert_j(x[t])``,
``[T, hidden]``.

- :func:`loop_experts` (eager, what the CPU runs) loops over the experts the batch uses, as
  transformers does: two matrix products per used expert over its tokens. Finding them reads
  the routing on the host, so it cannot run inside a CUDA graph.
- :func:`grouped_experts` (CUDA) sorts the (token, expert) pairs by expert and runs both
  projections as grouped matrix products (``torch.nn.functional.grouped_mm``) over the sorted
  rows, group boundaries computed on the device: fixed shapes and no host sync, so the decode
  step stays one CUDA graph. Each pair's output goes back to its slot and the ``k`` slots are
  summed, a fixed order whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SiluMul = Callable[[torch.Tensor], torch.Tensor]
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, SiluMul], torch.Tensor]


def loop_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    silu_mul: SiluMul,
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():  # ascending, as transformers adds them up
        token, slot = torch.where(experts == expert)
        hidden = silu_mul(F.linear(x[token], gate_up[expert]))
        out.index_add_(0, token, F.linear(hidden, down[expert]) * weights[token, slot, None])
    return out


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    silu_mul: SiluMul,
) -> torch.Tensor:
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)  # pairs grouped by expert
    ids = torch.arange(gate_up.shape[0], device=x.device)
    ends = torch.searchsorted(flat[order], ids, right=True).to(torch.int32)  # [E] end of each expert's rows
    rows = x.index_select(0, order // k)  # [T * k, hidden]
    hidden = silu_mul(F.grouped_mm(rows, gate_up.transpose(1, 2), offs=ends))  # [T * k, I]
    out = F.grouped_mm(hidden, down.transpose(1, 2), offs=ends) * weights.reshape(-1)[order, None]
    return torch.empty_like(out).index_copy_(0, order, out).view(tokens, k, -1).sum(dim=1)
