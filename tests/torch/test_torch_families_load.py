"""Loading every supported family: ``config.json`` as released checkpoints (transformers 4.x
names) and as transformers 5 write it give the same model; the tensors the engine expects are
exactly those ``save_pretrained`` writes; an unsupported family is refused by name before any
weight is read; a weight update A → B of the same family then generates B's greedy tokens,
and a checkpoint that does not fit is refused naming the tensor."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.backend import GenerationRequest
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import UnsupportedModelError
from engines.torch_backend.families import SUPPORTED, read_hf_config, read_model_dir
from engines.torch_backend.weight_update import CheckpointMismatch
from engines.torch_backend.weights import hf_shapes
from tests.torch.families import FAMILIES, Checkpoints, transformers_model
from tests.torch.reference import engine_options, hf_greedy, run_to_end

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
# A tensor only the family has (or a layer's own), left out of a checkpoint to be refused.
OWN_TENSOR = {
    "llama": "model.layers.1.mlp.up_proj.weight",
    "qwen2": "model.layers.0.self_attn.k_proj.bias",
    "qwen3": "model.layers.1.self_attn.q_norm.weight",
    "mistral": "model.layers.0.self_attn.o_proj.weight",
    "qwen3_moe": "model.layers.2.mlp.experts.7.down_proj.weight",
}


def transformers_4_layout(config: dict[str, Any]) -> dict[str, Any]:
    """The keys released checkpoints write: ``torch_dtype``, ``rope_theta`` (and
    ``rope_scaling``), ``num_experts``, instead of transformers 5's."""
    old = {key: value for key, value in config.items() if key not in ("dtype", "rope_parameters", "num_local_experts")}
    rope = dict(config["rope_parameters"])
    old["rope_theta"] = rope.pop("rope_theta")
    if rope.pop("rope_type") != "default":
        old["rope_scaling"] = rope
    old["torch_dtype"] = config["dtype"]
    if "num_local_experts" in config:
        old["num_experts"] = config["num_local_experts"]
    return old


def greedy_tokens(backend: TorchBackend, prompt: list[int], count: int) -> list[int]:
    outputs = run_to_end(backend, GenerationRequest("r", prompt, max_tokens=count, temperature=0.0))["r"]
    return [token for output in outputs for token in output.new_tokens]


def write_checkpoint(path: Path, config_dir: Path, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    shutil.copy(config_dir / "config.json", path / "config.json")
    save_file(weights, str(path / "model.safetensors"))
    return path


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_4_and_5_layouts_give_the_same_model(
    checkpoints: Checkpoints, family: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = checkpoints.get(family)
    v5 = json.loads((checkpoint.path / "config.json").read_text())
    v4 = transformers_4_layout(v5)
    assert read_hf_config(v4) == read_hf_config(v5) == read_model_dir(checkpoint.path)
    old = write_checkpoint(tmp_path / "v4", checkpoint.path, checkpoint_tensors(checkpoint.path))
    (old / "config.json").write_text(json.dumps(v4))
    expected = hf_greedy(AutoModelForCausalLM.from_pretrained(old).eval(), PROMPT, 12)
    assert expected == hf_greedy(checkpoint.reference, PROMPT, 12)  # transformers reads both alike too
    assert greedy_tokens(TorchBackend(engine_options(), str(old)), PROMPT, 12) == expected


@pytest.mark.parametrize(
    ("family", "changes"),
    [*((family, {}) for family in FAMILIES), ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []})],
)
def test_the_expected_tensors_are_what_save_pretrained_writes(
    family: str, changes: dict[str, Any], tmp_path: Path
) -> None:
    transformers_model(family, 0, **changes).save_pretrained(tmp_path)
    config = read_model_dir(tmp_path)
    written = {name: tuple(tensor.shape) for name, tensor in checkpoint_tensors(tmp_path).items()}
    assert hf_shapes(config) == written
    if config.moe is not None:
        assert [config.sparse(layer) for layer in range(config.num_layers)] == [
            f"model.layers.{layer}.mlp.gate.weight" in written for layer in range(config.num_layers)
        ]


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported by the torch backend (supported: "),
        (
            {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]},
            "are not a causal LM the torch backend runs (for model_type 'qwen2': Qwen2ForCausalLM)",
        ),
        ({"architectures": ["GPT2LMHeadModel"]}, "(no model_type) are not supported"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
            "qwen2 with use_sliding_window (a window in some layers only) is not supported",
        ),
    ],
)
def test_what_the_engine_does_not_run_is_refused_before_any_weight_is_read(
    checkpoints: Checkpoints, tmp_path: Path, config: dict[str, Any], refusal: str
) -> None:
    base = json.loads((checkpoints.get("qwen2").path / "config.json").read_text())
    for key in ("model_type", "architectures", "layer_types"):  # layer_types: as transformers 4.x wrote it
        base.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(base | config))
    (tmp_path / "model.safetensors").write_bytes(b"not read: the family is refused first")
    with pytest.raises(UnsupportedModelError) as refused:
        TorchBackend(engine_options(), str(tmp_path))
    assert refusal in str(refused.value)
    if config.get("model_type") == "gemma2":
        assert ", ".join(SUPPORTED) in str(refused.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_weight_update_from_a_to_b_generates_b_tokens(checkpoints: Checkpoints, family: str) -> None:
    """Swapped 5 tokens into a request: it continues as B continues those tokens."""
    a, b = checkpoints.get(family, seed=1), checkpoints.get(family, seed=2)
    assert hf_greedy(a.reference, PROMPT, 16) != hf_greedy(b.reference, PROMPT, 16)
    backend = TorchBackend(engine_options(), str(a.path))
    backend.add(GenerationRequest("r", PROMPT, max_tokens=16, temperature=0.0))
    generated: list[int] = []
    while len(generated) < 5:
        generated += [token for output in backend._step() for token in output.new_tokens]
    asyncio.run(backend.swap_weights(backend.stage_weights(b.path)))
    while backend.has_work():
        generated += [token for output in backend._step() for token in output.new_tokens]
    assert generated[:5] == hf_greedy(a.reference, PROMPT, 5)
    assert generated[5:] == hf_greedy(b.reference, PROMPT + generated[:5], 11)
    assert greedy_tokens(backend, PROMPT, 16) == hf_greedy(b.reference, PROMPT, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_that_does_not_fit_the_family_is_refused_naming_the_tensor(
    checkpoints: Checkpoints, family: str, tmp_path: Path
) -> None:
    a = checkpoints.get(family)
    backend = TorchBackend(engine_options(), str(a.path))
    weights = checkpoint_tensors(a.path)
    own = OWN_TENSOR[family]
    missing = write_checkpoint(tmp_path / "missing", a.path, {k: v for k, v in weights.items() if k != own})
    bf16 = write_checkpoint(tmp_path / "bf16", a.path, {k: v.to(torch.bfloat16) for k, v in weights.items()})
    wider = {k: torch.cat([v, v]) if k == own else v for k, v in weights.items()}
    shape = write_checkpoint(tmp_path / "shape", a.path, wider)
    other = checkpoints.get("qwen3" if family != "qwen3" else "qwen2").path  # q/k norms, or biases and another head_dim
    for path, message in (
        (missing, f"{own} is missing from the checkpoint"),
        (bf16, "has dtype BF16, the running model's is float32"),
        (shape, f"{own} (in model.safetensors) has shape"),
        (other, "model.layers.0."),
    ):
        with pytest.raises(CheckpointMismatch) as refused:
            backend.stage_weights(path)
        assert refused.value.code == 400 and message in refused.value.message, refused.value.message
