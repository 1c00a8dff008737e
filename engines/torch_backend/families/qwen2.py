"""Qwen2 and Qwen2.5: Llama's decoder with biases on the q, k and v projections (never on o,
nor in the MLP); the small sizes tie the output layer to the embeddings
(``tie_word_embeddings``). ``use_sliding_window`` is false in every released checkpoint; one
that sets it (a window in the upper layers only) is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families.common import Family, refuse_layer_windows


def read(config: dict[str, Any], common: ModelConfig) -> ModelConfig:
    refuse_layer_windows(config, "qwen2")
    return replace(common, qkv_bias=True)


def write(config: ModelConfig) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None}


FAMILY = Family("qwen2", "Qwen2ForCausalLM", read, write)
