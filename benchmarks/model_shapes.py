"""Model shapes for the engine benchmarks, as random checkpoints made on the fly.

``default`` is the engine's built-in random model (no checkpoint). The others are written
once into a directory as a Hugging Face checkpoint (``config.json`` and ``model.safetensors``,
weights drawn from normal(0, 0.02), norms at one, in the benchmark's dtype), so the engine
loads them as ``--model`` would and transformers loads the very same weights. A directory
that already holds the shape is reused. ``layers`` keeps a shape's layers (and its vocabulary,
its experts) but fewer of them: a CPU can hold a few layers of Mistral-7B or of
Qwen3-30B-A3B. :data:`FAMILY_SHAPES` names the released model each family is measured on.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from engines.torch_backend.config import ModelConfig, MoeConfig, RopeConfig
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
    # Qwen2.5-1.5B: 1.54 B parameters; biases on q, k, v; tied embeddings.
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0),
        tie_word_embeddings=True,
        family="qwen2",
        qkv_bias=True,
    ),
    # Qwen3-1.7B: 1.72 B parameters; head norms on q and k; head_dim 128 over hidden 2048 / 16 heads.
    "qwen3-1.7b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0),
        tie_word_embeddings=True,
        family="qwen3",
        qk_norm=True,
    ),
    # Mistral-7B-v0.1: 7.24 B parameters; a 4096-token sliding window.
    "mistral-7b": ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        family="mistral",
        sliding_window=4096,
    ),
    # Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active: 128 experts of width 768, 8 per token.
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0),
        family="qwen3_moe",
        qk_norm=True,
        moe=MoeConfig(num_experts=128, experts_per_token=8, intermediate_size=768, norm_topk_prob=True),
    ),
}
FAMILY_SHAPES = {
    "llama": "llama-1b",
    "qwen2": "qwen2.5-1.5b",
    "qwen3": "qwen3-1.7b",
    "mistral": "mistral-7b",
    "qwen3_moe": "qwen3-30b-a3b",
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def shape_config(shape: str, layers: int | None = None) -> ModelConfig | None:
    """``shape``'s config (None: the built-in model), with ``layers`` layers if given."""
    config = SHAPES[shape]
    if config is None or layers is None:
        return config
    return dataclasses.replace(config, num_layers=layers)


def checkpoint(
    shape: str, directory: Path, dtype: torch.dtype, device: torch.device, layers: int | None = None
) -> Path:
    """The checkpoint directory of ``shape`` (with ``layers`` layers if given) in ``dtype``
    under ``directory``, written if missing. Weights are drawn on ``device`` (fast on a GPU)
    one tensor at a time."""
    config = shape_config(shape, layers)
    if config is None:
        raise ValueError("the default shape is the engine's built-in model: it has no checkpoint")
    name = _DTYPE_NAMES[dtype]
    target = directory / (f"{shape}-{name}" if layers is None else f"{shape}-{layers}-layers-{name}")
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
