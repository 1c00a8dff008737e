"""Qwen3 (dense): Llama's decoder with an RMSNorm over each head of q and of k (weights
``self_attn.q_norm`` and ``self_attn.k_norm``, ``head_dim`` wide) applied before the rotary
embedding, and an explicit ``head_dim`` (128 in the released sizes, 128 when absent, as in
transformers) that need not be ``hidden_size / num_attention_heads``. ``attention_bias`` puts
a bias on q, k, v and o. ``use_sliding_window`` (false in every release) is refused, as for
Qwen2."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families.common import Family, refuse_layer_windows

DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config default


def read(config: dict[str, Any], common: ModelConfig) -> ModelConfig:
    refuse_layer_windows(config, "qwen3")
    bias = bool(config.get("attention_bias", False))
    head_dim = config.get("head_dim") or DEFAULT_HEAD_DIM
    return replace(common, head_dim=head_dim, qk_norm=True, qkv_bias=bias, o_bias=bias)


def write(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "use_sliding_window": False, "sliding_window": None}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", read, write)
