"""Llama (2, 3, 3.1, 3.2): the plain decoder. ``attention_bias`` puts a bias on q, k, v and o
alike; ``mlp_bias`` on the MLP's three projections. Llama 3.x's rope scaling is read with
every family's rope (:class:`~engines.torch_backend.config.RopeConfig`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families.common import Family


def read(config: dict[str, Any], common: ModelConfig) -> ModelConfig:
    bias = bool(config.get("attention_bias", False))
    return replace(common, qkv_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)))


def write(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}


FAMILY = Family("llama", "LlamaForCausalLM", read, write)
