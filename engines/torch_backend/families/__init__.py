"""The model families the torch backend serves, chosen by ``config.json`` from one registry.

A checkpoint's family is its ``model_type``; without one, the family whose causal LM its
``architectures`` names; without either, ``llama``. An ``architectures`` list that names
other classes only (a classifier head, say) is refused, and so is a ``model_type`` not in
the registry: the refusal names it and lists the supported ones, and comes before any weight
is read (:func:`read_model_dir` reads only the JSON files).

**Adding a family** is one module here exposing ``FAMILY``
(:class:`~engines.torch_backend.families.common.Family`): its ``read`` maps the family's own
``config.json`` keys onto :class:`~engines.torch_backend.config.ModelConfig`'s features (or
refuses them), its ``write`` gives them back; then one entry in :data:`REGISTRY`, which
refuses duplicates. A family that needs a feature the decoder lacks adds it to
``ModelConfig`` and to ``model.py`` / ``weights.py``, driven by that field, never by the
family's name. Tests: tests/torch/test_torch_families*.py parametrise over
:data:`SUPPORTED`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engines.torch_backend.config import ModelConfig, UnsupportedModelError
from engines.torch_backend.families import llama, mistral, qwen2, qwen3, qwen3_moe
from engines.torch_backend.families.common import Family, read_common, write_common


def _registry(*families: Family) -> dict[str, Family]:
    registry: dict[str, Family] = {}
    for family in families:
        if family.model_type in registry:
            raise ValueError(f"model_type {family.model_type!r} is registered twice")
        registry[family.model_type] = family
    return registry


REGISTRY = _registry(llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, qwen3_moe.FAMILY)
SUPPORTED = tuple(sorted(REGISTRY))
DEFAULT_FAMILY = "llama"


def family_of(config: dict[str, Any]) -> Family:
    """The family ``config.json`` describes, or :class:`UnsupportedModelError` naming it."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if model_type is None:
        by_class = [family for family in REGISTRY.values() if family.causal_lm in architectures]
        if not by_class and architectures:
            raise UnsupportedModelError(
                f"architectures {architectures} (no model_type) are not supported "
                f"(the torch backend runs {', '.join(family.causal_lm for family in REGISTRY.values())})"
            )
        return by_class[0] if by_class else REGISTRY[DEFAULT_FAMILY]
    family = REGISTRY.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the torch backend (supported: {', '.join(SUPPORTED)})"
        )
    if architectures and family.causal_lm not in architectures:
        raise UnsupportedModelError(
            f"architectures {architectures} are not a causal LM the torch backend runs "
            f"(for model_type {model_type!r}: {family.causal_lm})"
        )
    return family


def read_hf_config(config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """The engine's config from ``config.json`` (either transformers layout) and, for EOS,
    ``generation_config.json``."""
    family = family_of(config)
    return family.read(config, read_common(family.model_type, config, generation_config))


def read_model_dir(model_dir: Path) -> ModelConfig:
    """The config of a Hugging Face model directory, from its JSON files only."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    return read_hf_config(json.loads(config_path.read_text()), generation)


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """A transformers 5.x ``config.json`` for this config (tests and benchmarks build
    transformers' model of the same family from it)."""
    family = REGISTRY[config.family]
    return write_common(config, family.causal_lm) | family.write(config)


__all__ = ["REGISTRY", "SUPPORTED", "Family", "family_of", "hf_config", "read_hf_config", "read_model_dir"]
