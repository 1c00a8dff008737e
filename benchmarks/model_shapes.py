"""Model shapes for the engine benchmarks, as random checkpoints made on the fly.

``default`` is the engine's built-in random model (no checkpoint). The others are written
once into a directory as a Hugging Face checkpoint (``config.json`` and ``model.safetensors``,
weights drawn from normal(0, 0.02), norms at one, in the benchmark's dtype), so the engine
loads them as ``--model`` would and transformers loads the very same weights. A directory
that already holds the shape is reused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from engines.torch_backend.config import ModelConfig, RopeConfig
from engines.torch_backend.families import hf_config
from engines.torch_backend.weights import INIT_STD, hf_shapes

_LLAMA3_ROPE = RopeConfig(
    theta=500000.0,
    type="llama3",
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

SHAPES: dict[str, ModelConfig | None] = {
    "default": None,
    # A CPU-sized stand-in, to check the benchmark itself.
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    ),
    # Llama-3.2-1B: 1.24 B parameters.
    "llama-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope=_LLAMA3_ROPE,
        tie_word_embeddings=True,
    ),
    # Llama-3.1-8B: 8.0 B parameters.
    "llama-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope=dataclasses.replace(_LLAMA3_ROPE, factor=8.0),
    ),
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def checkpoint(shape: str, directory: Path, dtype: torch.dtype, device: torch.device) -> Path:
    """The checkpoint directory of ``shape`` in ``dtype`` under ``directory``, written if missing.
    Weights are drawn on ``device`` (fast on a GPU) one tensor at a time."""
    config = SHAPES[shape]
    if config is None:
        raise ValueError("the default shape is the engine's built-in model: it has no checkpoint")
    name = _DTYPE_NAMES[dtype]
    target = directory / f"{shape}-{name}"
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(config, dtype=name)
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for tensor_name, tensor_shape in hf_shapes(config).items():
        if tensor_name.endswith("norm.weight"):
            weights[tensor_name] = torch.ones(tensor_shape, dtype=dtype)
        else:
            drawn = torch.randn(tensor_shape, generator=generator, device=device) * INIT_STD
            weights[tensor_name] = drawn.to(dtype).cpu()
    save_file(weights, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(hf_config(config), indent=1))
    return target


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads at least once: every parameter (tied ones once)."""
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
