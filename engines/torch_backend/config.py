"""The model architecture, read from a Hugging Face ``config.json`` or the built-in default.

Both config layouts load: transformers 4.x (``rope_theta``, ``rope_scaling``, ``torch_dtype``)
and 5.x (``rope_parameters``, ``dtype``). What the engine does not implement is refused here,
at load, with the reason: a rope type other than default, linear and llama3, partial rotary
embeddings, an activation other than SiLU, a model type other than ``llama``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

RopeType = Literal["default", "linear", "llama3"]
SUPPORTED_ROPE_TYPES: tuple[RopeType, ...] = ("default", "linear", "llama3")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine does not implement."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> RopeConfig:
        parameters = config.get("rope_parameters")
        if parameters is None:  # transformers 4.x
            parameters = {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}
        elif not isinstance(parameters, dict) or any(isinstance(value, dict) for value in parameters.values()):
            raise UnsupportedModelError(f"per-layer rope_parameters are not supported: {parameters!r}")
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not implemented by the torch backend (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        partial = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
        theta = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
        if rope_type == "default":
            return cls(theta=theta)
        required = (
            ("factor",)
            if rope_type == "linear"
            else (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            )
        )
        missing = [key for key in required if key not in parameters]
        if missing:
            raise UnsupportedModelError(f"rope type {rope_type!r} needs {', '.join(missing)} in the config")
        return cls(theta=theta, type=rope_type, **{key: parameters[key] for key in required})

    def to_hf(self) -> dict[str, Any]:
        """The 5.x ``rope_parameters`` entry."""
        parameters: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.type != "default":
            parameters["factor"] = self.factor
        if self.type == "llama3":
            parameters.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return parameters


def _token_ids(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, int) for item in value):
        return tuple(value)
    raise UnsupportedModelError(f"{key} must be an int, a list of ints or null, not {value!r}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-family decoder. The defaults are the built-in random model: about 3.1 M
    parameters over a 256-token byte vocabulary, small enough for any laptop CPU."""

    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: str | None = None  # the checkpoint's; None: the device's default
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        model_type = config.get("model_type", "llama")
        if model_type != "llama":
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported (the torch backend runs 'llama')")
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise UnsupportedModelError(f"hidden_act {activation!r} is not supported (only 'silu')")
        dtype = config.get("dtype") or config.get("torch_dtype")
        if dtype is not None and dtype not in DTYPE_NAMES:
            raise UnsupportedModelError(f"dtype {dtype!r} is not supported ({', '.join(DTYPE_NAMES)})")
        # generate() reads generation_config.json first; so does the engine.
        eos_source = generation_config if generation_config and "eos_token_id" in generation_config else config
        heads = config["num_attention_heads"]
        try:
            return cls(
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
                attention_bias=config.get("attention_bias", False),
                mlp_bias=config.get("mlp_bias", False),
                dtype=dtype,
                eos_token_ids=_token_ids(eos_source.get("eos_token_id"), "eos_token_id"),
            )
        except KeyError as exc:
            raise UnsupportedModelError(f"config.json lacks {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
        generation_path = model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
        return cls.from_hf(json.loads(config_path.read_text()), generation)

    def to_hf(self) -> dict[str, Any]:
        """A transformers 5.x ``config.json`` for this architecture (the reference tests build
        ``LlamaForCausalLM`` from it)."""
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "dtype": self.dtype,
            "bos_token_id": None,
            "eos_token_id": list(self.eos_token_ids) or None,
            "pad_token_id": None,
        }
