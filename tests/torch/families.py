"""Tiny random checkpoints of every supported family, written by transformers' own
``save_pretrained``, with the transformers model that wrote them as the reference.

Each is vocab 256, 2 layers (Qwen3-MoE: 3, the middle one dense through ``mlp_only_layers``,
8 experts, top 2, renormalised), 4 query heads over 2 key/value heads. What makes each family
itself is on: tied embeddings (Qwen2's small sizes) and its q/k/v biases, a ``head_dim`` other
than hidden / heads (Qwen3), an 8-token sliding window (Mistral), experts (Qwen3-MoE).
Weights are transformers' initialisation at ``initializer_range`` 0.1 (0.02 leaves a 2-layer
model repeating its input), then norms, biases and the router drawn away from their
initial ones and zeros so that they matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.torch_backend.families import SUPPORTED

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
SPECIFIC: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 24},
    "mistral": {"sliding_window": 8},
    "qwen3_moe": {
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
    },
}
assert sorted(SPECIFIC) == list(SUPPORTED), "every supported family has a tiny checkpoint"
FAMILIES = list(SUPPORTED)


def transformers_model(family: str, seed: int, **changes: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **(COMMON | SPECIFIC[family] | changes))
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith("mlp.gate.weight"):
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


@dataclass(frozen=True)
class Checkpoint:
    family: str
    path: Path
    reference: Any  # the transformers model that wrote it


class Checkpoints:
    """Checkpoints made on first use and kept for the session (a fixture in conftest.py)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._made: dict[tuple[str, int], Checkpoint] = {}

    def get(self, family: str, seed: int = 1) -> Checkpoint:
        key = (family, seed)
        if key not in self._made:
            model = transformers_model(family, seed)
            path = self._root / f"{family}-{seed}"
            model.save_pretrained(path)
            self._made[key] = Checkpoint(family, path, model)
        return self._made[key]
