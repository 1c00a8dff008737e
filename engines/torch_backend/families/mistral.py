"""Mistral: Llama's decoder without biases, whose attention may be limited to a sliding window:
with ``sliding_window`` W (4096 in Mistral-7B-v0.1; null from v0.2 on; 4096 when the key is
absent, as in transformers), a query attends to itself and the W - 1 tokens before it, in
every layer. The engine honours it: the prefill and gathered decode masks and the paged decode
kernel read only those keys, so generation past the window equals transformers'."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families.common import Family

DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig default


def read(config: dict[str, Any], common: ModelConfig) -> ModelConfig:
    return replace(common, sliding_window=config.get("sliding_window", DEFAULT_SLIDING_WINDOW))


def write(config: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window}


FAMILY = Family("mistral", "MistralForCausalLM", read, write)
