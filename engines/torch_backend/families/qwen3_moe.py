"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (head norms on q and k,
biases per ``attention_bias``) with a mixture-of-experts MLP. Each sparse layer has a router
(``mlp.gate``, ``num_experts`` x hidden) whose softmax picks ``num_experts_per_tok`` experts
per token, weighted by their probabilities (renormalised over the chosen ones when
``norm_topk_prob``); each expert is a SwiGLU MLP of width ``moe_intermediate_size``, stored as
``mlp.experts.E.{gate,up,down}_proj``. Layers in ``mlp_only_layers``, and those whose number
plus one is not a multiple of ``decoder_sparse_step``, have a dense MLP of width
``intermediate_size`` instead. The expert count is ``num_experts`` in transformers 4.x and in
the released checkpoints, ``num_local_experts`` as transformers 5 writes it. Unlike Qwen2 and
Qwen3, its ``sliding_window`` (with ``use_sliding_window``, false in the releases) applies to
every layer, and is honoured as Mistral's is. ``head_dim`` defaults to hidden / heads."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.torch_backend.config import ModelConfig, MoeConfig, UnsupportedModelError
from engines.torch_backend.families.common import Family


def read(config: dict[str, Any], common: ModelConfig) -> ModelConfig:
    bias = bool(config.get("attention_bias", False))
    experts = config.get("num_local_experts", config.get("num_experts"))
    if experts is None:
        raise UnsupportedModelError("config.json lacks 'num_experts' (or 'num_local_experts')")
    moe = None
    if experts > 0:
        try:
            moe = MoeConfig(
                num_experts=experts,
                experts_per_token=config["num_experts_per_tok"],
                intermediate_size=config["moe_intermediate_size"],
                norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                decoder_sparse_step=config.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            )
        except KeyError as exc:
            raise UnsupportedModelError(f"config.json lacks {exc.args[0]!r}") from None
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    return replace(common, qk_norm=True, qkv_bias=bias, o_bias=bias, moe=moe, sliding_window=window)


def write(config: ModelConfig) -> dict[str, Any]:
    moe = config.moe
    experts = (
        {
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.intermediate_size,
            "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": moe.decoder_sparse_step,
            "mlp_only_layers": list(moe.mlp_only_layers),
        }
        if moe is not None
        else {"num_local_experts": 0}
    )
    return {
        "attention_bias": config.qkv_bias,
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        **experts,
    }


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", read, write)
