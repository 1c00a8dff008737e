"""The model architecture the engine runs: one generic decoder described by data.

Every supported family (:mod:`engines.torch_backend.families`, which reads ``config.json``)
is this decoder with some features on: biases on q, k and v (Qwen2) or on o too (Llama with
``attention_bias``), an RMSNorm over each head of q and k (Qwen3), attention limited to a
sliding window (Mistral), a mixture-of-experts MLP in some layers (Qwen3-MoE). The defaults are
the built-in random Llama model. Rope settings are read here for every family: both layouts,
transformers 4.x (``rope_theta``, ``rope_scaling``) and 5.x (``rope_parameters``); what the
engine does not implement is refused with the reason (a rope type other than default, linear
and llama3, partial rotary embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP (Qwen3-MoE): a softmax router picks ``experts_per_token`` of
    ``num_experts`` SwiGLU experts of width ``intermediate_size`` per token, their outputs
    weighted by the router's probabilities (renormalised over the chosen ones when
    ``norm_topk_prob``). Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
    ``i + 1`` is not a multiple of ``decoder_sparse_step``; a dense layer has the model's
    dense MLP (``ModelConfig.intermediate_size``)."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok {self.experts_per_token} must be between 1 and num_experts {self.num_experts}"
            )
        if self.decoder_sparse_step < 1:
            raise UnsupportedModelError(f"decoder_sparse_step {self.decoder_sparse_step} must be at least 1")

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the experts (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder of one of the supported families. The defaults are the built-in random model:
    about 3.1 M Llama parameters over a 256-token byte vocabulary, small enough for any laptop CPU."""

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
    family: str = "llama"  # the model_type it was read as, written back by families.hf_config
    qkv_bias: bool = False  # biases on the q, k and v projections
    o_bias: bool = False  # a bias on the output projection
    mlp_bias: bool = False  # biases on the dense MLP's projections
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before the rotary embedding
    sliding_window: int | None = None  # a query attends to itself and the window - 1 tokens before it
    moe: MoeConfig | None = None
    dtype: str | None = None  # the checkpoint's; None: the device's default
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding_window {self.sliding_window} must be at least 1 (or null)")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.moe is not None and self.moe.sparse(layer)
