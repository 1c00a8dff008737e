"""The MLP blocks of a decoder layer: a dense SwiGLU, or a mixture of experts (Qwen3-MoE).

Both take the normed hidden states and the residual and return ``residual + mlp(x)``, so the
dense block keeps its down projection fused with the residual add. :class:`SparseMoe` routes
as transformers' ``Qwen3MoeSparseMoeBlock``: router logits in the model's dtype, softmax in
float32, the top ``k`` probabilities (renormalised when ``norm_topk_prob``) cast back to the
model's dtype; the experts run through ``kernels.moe_experts``
(:mod:`engines.torch_backend.experts`). The experts' weights are stacked per layer,
``gate_up`` ``[E, 2 * I, hidden]`` and ``down`` ``[E, hidden, I]``;
:mod:`engines.torch_backend.weights` maps the checkpoint's per-expert tensors into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.torch_backend.config import ModelConfig, MoeConfig
from engines.torch_backend.kernels import Kernels


def project_add(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``residual + linear(x)`` as one fused matrix product."""
    out = torch.addmm(residual, x, linear.weight.t())
    return out if linear.bias is None else out.add_(linear.bias)


class DenseMlp(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=config.mlp_bias)
        self.down = nn.Linear(inter, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up.weight, self.gate_up.bias)
        return project_add(residual, kernels.silu_mul(gate_up), self.down)


class SparseMoe(nn.Module):
    def __init__(self, hidden: int, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.router = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden))
        self.down = nn.Parameter(torch.empty(moe.num_experts, hidden, moe.intermediate_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        logits = F.linear(x, self.router)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.experts_per_token, dim=-1)  # [T, k]
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = kernels.moe_experts(x, weights.to(x.dtype), experts, self.gate_up, self.down, kernels.silu_mul)
        return residual + out
