"""Weights under Hugging Face names: drawn from a seed for the default model, or read from a
checkpoint's ``*.safetensors``, then copied into the model's fused parameters.

The names and shapes follow the config's features (:func:`hf_shapes`), as the released
checkpoints of each family and transformers' ``save_pretrained`` write them: biases where
the family has them, ``self_attn.q_norm`` / ``k_norm`` (Qwen3), and per layer either a dense
``mlp.{gate,up,down}_proj`` or a router ``mlp.gate`` with ``mlp.experts.E.{gate,up,down}_proj``
for each expert ``E`` (Qwen3-MoE), which :func:`parameter_for` maps into the stacked expert
parameters. Every parameter must be filled exactly once: a missing or unknown tensor, or one
of the wrong shape, stops the load with its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from engines.torch_backend.config import ModelConfig, UnsupportedModelError
from engines.torch_backend.mlp import DenseMlp, SparseMoe
from engines.torch_backend.model import DecoderLayer, DecoderModel

INIT_STD = 0.02  # transformers' initializer_range
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
Rows = slice | tuple[int, slice]  # the part of a parameter one checkpoint tensor fills


def _projections(
    shapes: dict[str, tuple[int, ...]], prefix: str, sizes: dict[str, tuple[int, int]], bias: bool
) -> None:
    for name, shape in sizes.items():
        shapes[f"{prefix}{name}.weight"] = shape
        if bias:
            shapes[f"{prefix}{name}.bias"] = (shape[0],)


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the family's Hugging Face checkpoint and its shape."""
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
        qkv = {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden)}
        _projections(shapes, f"{prefix}self_attn.", qkv, config.qkv_bias)
        _projections(shapes, f"{prefix}self_attn.", {"o_proj": (hidden, q_size)}, config.o_bias)
        if config.qk_norm:
            shapes[f"{prefix}self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{prefix}self_attn.k_norm.weight"] = (head_dim,)
        if config.moe is not None and config.sparse(i):
            moe = config.moe
            shapes[f"{prefix}mlp.gate.weight"] = (moe.num_experts, hidden)
            width = moe.intermediate_size
            expert = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
            for e in range(moe.num_experts):
                _projections(shapes, f"{prefix}mlp.experts.{e}.", expert, False)
        else:
            dense = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
            _projections(shapes, f"{prefix}mlp.", dense, config.mlp_bias)
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    return shapes


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights as transformers initialises them: normal(0, 0.02), norms at one,
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


def parameter_for(model: DecoderModel, name: str) -> tuple[torch.Tensor, Rows]:
    """The parameter (and the part of it) that a Hugging Face tensor of ``hf_shapes`` fills."""
    if name == "model.embed_tokens.weight":
        return model.embed.weight, slice(None)
    if name == "model.norm.weight":
        return model.norm.weight, slice(None)
    if name == "lm_head.weight":
        return model.lm_head.weight, slice(None)
    parts = name.split(".")
    layer = model.layers[int(parts[2])]
    assert isinstance(layer, DecoderLayer), "the model's layers are decoder layers"
    module, kind = ".".join(parts[3:-1]), parts[-1]
    if module.startswith("mlp."):
        return _mlp_part(layer.mlp, parts[4:-1], kind)
    config = model.config
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    owners = {
        "self_attn.q_proj": (layer.qkv, slice(0, q_size)),
        "self_attn.k_proj": (layer.qkv, slice(q_size, q_size + kv_size)),
        "self_attn.v_proj": (layer.qkv, slice(q_size + kv_size, None)),
        "self_attn.o_proj": (layer.o, slice(None)),
        "self_attn.q_norm": (layer.q_norm, slice(None)),
        "self_attn.k_norm": (layer.k_norm, slice(None)),
        "input_layernorm": (layer.input_norm, slice(None)),
        "post_attention_layernorm": (layer.post_norm, slice(None)),
    }
    owner, rows = owners[module]
    return getattr(owner, kind), rows


def _mlp_part(mlp: DenseMlp | SparseMoe, path: list[str], kind: str) -> tuple[torch.Tensor, Rows]:
    """``path``: the name's parts after ``mlp.``, without the last (``weight`` / ``bias``)."""
    if isinstance(mlp, DenseMlp):
        inter = mlp.down.weight.shape[1]
        owner, rows = {
            "gate_proj": (mlp.gate_up, slice(0, inter)),
            "up_proj": (mlp.gate_up, slice(inter, None)),
            "down_proj": (mlp.down, slice(None)),
        }[path[0]]
        return getattr(owner, kind), rows
    if path == ["gate"]:
        return mlp.router, slice(None)
    expert, projection = int(path[1]), path[2]  # experts.E.projection
    width = mlp.down.shape[2]
    if projection == "down_proj":
        return mlp.down, (expert, slice(None))
    return mlp.gate_up, (expert, slice(0, width) if projection == "gate_proj" else slice(width, None))


def build_model(
    config: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> DecoderModel:
    """A model on ``device`` in ``dtype`` holding exactly the given weights."""
    with torch.device("meta"):
        model = DecoderModel(config).to(dtype)
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
