"""What every family shares: the :class:`Family` record the registry holds, and the fields of
``config.json`` that all the supported families write alike (sizes, norms, rope, dtype, EOS).

A family module reads only what is its own on top of :func:`read_common` (biases, head norms,
the window, the experts) and refuses what the engine does not implement of it; it writes the
same keys back in :attr:`Family.write` so that transformers builds the same model from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.torch_backend.config import DTYPE_NAMES, ModelConfig, RopeConfig, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class Family:
    """One supported ``model_type``: ``read`` turns its ``config.json`` (and the common fields
    already read) into the engine's config; ``write`` gives the keys of its own that a
    transformers 5 ``config.json`` holds for that config."""

    model_type: str
    causal_lm: str  # the ``architectures`` entry of its causal LM, e.g. ``LlamaForCausalLM``
    read: Callable[[dict[str, Any], ModelConfig], ModelConfig]
    write: Callable[[ModelConfig], dict[str, Any]]


def token_ids(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, int) for item in value):
        return tuple(value)
    raise UnsupportedModelError(f"{key} must be an int, a list of ints or null, not {value!r}")


def read_common(model_type: str, config: dict[str, Any], generation_config: dict[str, Any] | None) -> ModelConfig:
    """The fields every family writes alike; a missing required key is named."""
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"hidden_act {activation!r} is not supported (only 'silu')")
    dtype = config.get("dtype") or config.get("torch_dtype")  # 5.x, 4.x
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported ({', '.join(DTYPE_NAMES)})")
    # generate() reads generation_config.json first; so does the engine.
    eos_source = generation_config if generation_config and "eos_token_id" in generation_config else config
    try:
        heads = config["num_attention_heads"]
        return ModelConfig(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(config),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            family=model_type,
            dtype=dtype,
            eos_token_ids=token_ids(eos_source.get("eos_token_id"), "eos_token_id"),
        )
    except KeyError as exc:
        raise UnsupportedModelError(f"config.json lacks {exc.args[0]!r}") from None


def write_common(config: ModelConfig, causal_lm: str) -> dict[str, Any]:
    """The transformers 5.x keys every family writes alike."""
    return {
        "model_type": config.family,
        "architectures": [causal_lm],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": config.rope.to_hf(),
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "dtype": config.dtype,
        "bos_token_id": None,
        "eos_token_id": list(config.eos_token_ids) or None,
        "pad_token_id": None,
    }


def refuse_layer_windows(config: dict[str, Any], model_type: str) -> None:
    """Qwen2 and Qwen3 limit attention to a window only in layers ``max_window_layers`` and
    after, and only with ``use_sliding_window`` (false in every released checkpoint): the
    engine's one mask per step cannot differ per layer, so such a checkpoint is refused."""
    window = config.get("sliding_window")
    layers = config.get("num_hidden_layers", 0)
    types = config.get("layer_types") or [
        "sliding_attention"
        if config.get("use_sliding_window") and window is not None and i >= config.get("max_window_layers", 28)
        else "full_attention"
        for i in range(layers)
    ]
    if config.get("use_sliding_window") and window is not None and "sliding_attention" in types:
        raise UnsupportedModelError(
            f"{model_type} with use_sliding_window (a window in some layers only) is not supported: "
            "released checkpoints set it false"
        )
