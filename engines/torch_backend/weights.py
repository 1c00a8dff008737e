"""Weights under Hugging Face names: drawn from a seed for the default model, or read from a
checkpoint's ``*.safetensors``, then copied into the model's fused parameters.

Every parameter must be filled exactly once: a missing or unknown tensor, or one of the wrong
shape, stops the load with its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from engines.torch_backend.config import ModelConfig, UnsupportedModelError
from engines.torch_backend.model import LlamaModel

INIT_STD = 0.02  # transformers' initializer_range for Llama
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face ``LlamaForCausalLM`` checkpoint and its shape."""
    hidden, head_dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        projections = {
            "self_attn.q_proj": (q_size, hidden),
            "self_attn.k_proj": (kv_size, hidden),
            "self_attn.v_proj": (kv_size, hidden),
            "self_attn.o_proj": (hidden, q_size),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }
        for name, shape in projections.items():
            shapes[f"{prefix}{name}.weight"] = shape
            biased = config.attention_bias if name.startswith("self_attn") else config.mlp_bias
            if biased:
                shapes[f"{prefix}{name}.bias"] = (shape[0],)
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    return shapes


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights as transformers initialises Llama: normal(0, 0.02), norms at one,
    biases at zero. The same seed gives the same model on every machine."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hf_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * INIT_STD
    return weights


def checkpoint_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of every ``*.safetensors`` file in the directory, one at a time."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def parameter_for(model: LlamaModel, name: str) -> tuple[torch.Tensor, slice]:
    """The parameter (and the rows of it) that a Hugging Face tensor fills."""
    config = model.config
    if name == "model.embed_tokens.weight":
        return model.embed.weight, slice(None)
    if name == "model.norm.weight":
        return model.norm.weight, slice(None)
    if name == "lm_head.weight":
        return model.lm_head.weight, slice(None)
    parts = name.split(".")
    layer: nn.Module = model.layers[int(parts[2])]
    module, kind = ".".join(parts[3:-1]), parts[-1]
    q_size, kv_size, inter = (
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
    )
    fused = {
        "self_attn.q_proj": (layer.qkv, slice(0, q_size)),
        "self_attn.k_proj": (layer.qkv, slice(q_size, q_size + kv_size)),
        "self_attn.v_proj": (layer.qkv, slice(q_size + kv_size, None)),
        "self_attn.o_proj": (layer.o, slice(None)),
        "mlp.gate_proj": (layer.gate_up, slice(0, inter)),
        "mlp.up_proj": (layer.gate_up, slice(inter, None)),
        "mlp.down_proj": (layer.down, slice(None)),
        "input_layernorm": (layer.input_norm, slice(None)),
        "post_attention_layernorm": (layer.post_norm, slice(None)),
    }
    owner, rows = fused[module]
    return getattr(owner, kind), rows


def build_model(
    config: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> LlamaModel:
    """A model on ``device`` in ``dtype`` holding exactly the given weights."""
    with torch.device("meta"):
        model = LlamaModel(config).to(dtype)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own copy
        model.lm_head.weight = model.embed.weight
    expected = hf_shapes(config)
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            if name not in expected:
                raise UnsupportedModelError(f"unexpected tensor {name!r} in the checkpoint")
            if tuple(tensor.shape) != expected[name]:
                raise UnsupportedModelError(f"{name} has shape {tuple(tensor.shape)}, the config says {expected[name]}")
            parameter, rows = parameter_for(model, name)
            parameter[rows].copy_(tensor)
            seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise UnsupportedModelError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    # Inference only: no parameter asks for gradients, so compiled pieces see the same guards
    # (requires_grad is one) at their load-time check as when serving.
    return model.requires_grad_(False).eval()
