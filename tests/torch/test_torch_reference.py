"""The engine's model against Hugging Face transformers' LlamaForCausalLM with the same
weights: logits through prefill and paged decode, greedy generation through the backend,
batch invariance, and checkpoints written by ``save_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engines.backend import GenerationRequest
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig, RopeConfig
from engines.torch_backend.families import hf_config, read_hf_config
from tests.torch.reference import (
    LLAMA3_ROPE,
    Harness,
    engine_model,
    engine_options,
    hf_greedy,
    hf_model,
    random_weights,
    tiny,
)

PROMPTS = [[5, 9, 200, 17, 3, 88, 41], [1], list(range(30, 75)), [250, 251, 252, 7, 7, 7, 7, 7, 9, 10, 11]]

CONFIGS = {
    "default-model": ModelConfig(),
    "gqa": tiny(),
    "multi-head": tiny(num_kv_heads=4),
    "multi-query": tiny(num_kv_heads=1),
    "tied-biased": tiny(tie_word_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True),
    "llama3-rope": tiny(rope=LLAMA3_ROPE),
    "linear-rope": tiny(rope=RopeConfig(theta=10000.0, type="linear", factor=4.0)),
    "head-dim-not-hidden-over-heads": tiny(head_dim=24),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name: str) -> None:
    config = CONFIGS[name]
    weights = random_weights(config, seed=7)
    if config.qkv_bias:  # transformers initialises biases at zero too; make them matter
        generator = torch.Generator().manual_seed(1)
        weights = {
            key: torch.randn(value.shape, generator=generator) * 0.1 if key.endswith(".bias") else value
            for key, value in weights.items()
        }
    reference = hf_model(config, weights)
    harness = Harness(engine_model(config, weights))
    # Prefill part of each sequence, decode the rest through the paged cache, all in one batch.
    full = {f"s{i}": prompt + [(7 * i + j) % 256 for j in range(12)] for i, prompt in enumerate(PROMPTS)}
    split = {
        rid: (tokens[: len(PROMPTS[int(rid[1:])])], tokens[len(PROMPTS[int(rid[1:])]) :])
        for rid, tokens in full.items()
    }
    ours = harness.forced_logits(split)
    with torch.inference_mode():
        for rid, tokens in full.items():
            expected = reference(torch.tensor([tokens])).logits[0, len(split[rid][0]) - 1 :]
            torch.testing.assert_close(ours[rid], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("overlap", [False, True], ids=["one at a time", "launched ahead"])
def test_greedy_generation_matches_transformers_generate(overlap: bool) -> None:
    """Also with steps launched ahead, whose input ids come from the step in flight on the device."""
    config = ModelConfig()
    backend = TorchBackend(engine_options(model_seed=3, overlap_steps=overlap))
    reference = hf_model(config, random_weights(config, seed=3))
    for i, prompt in enumerate(PROMPTS):
        backend.add(GenerationRequest(f"r{i}", prompt, max_tokens=24, temperature=0.0))
    generated = _run(backend)
    for i, prompt in enumerate(PROMPTS):
        assert generated[f"r{i}"] == hf_greedy(reference, prompt, 24), f"prompt {i}"


@pytest.mark.parametrize("overlap", [False, True], ids=["one at a time", "launched ahead"])
def test_a_batch_gives_each_prompt_its_alone_tokens(overlap: bool) -> None:
    backend = TorchBackend(engine_options(model_seed=11, overlap_steps=overlap))
    prompts = {f"p{i}": [(13 * i + k * k) % 256 for k in range(3 + 5 * i)] for i in range(12)}
    alone = {}
    for rid, prompt in prompts.items():
        backend.add(GenerationRequest(rid, prompt, max_tokens=16, temperature=0.0))
        alone.update(_run(backend))
    # Staggered arrivals: requests join a running batch at different steps.
    batched: dict[str, list[int]] = {rid: [] for rid in prompts}
    pending = list(prompts.items())
    while pending or backend.has_work():
        for _ in range(3):
            if pending:
                rid, prompt = pending.pop(0)
                backend.add(GenerationRequest(rid, prompt, max_tokens=16, temperature=0.0))
        for output in _step(backend):
            batched[output.request_id] += output.new_tokens
    assert batched == alone


def test_loads_a_save_pretrained_directory_with_its_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama_config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
    )
    reference = LlamaForCausalLM(llama_config).eval()
    reference.save_pretrained(tmp_path)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(["héllo wörld, the engine streams tokens"] * 20, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    backend = TorchBackend(engine_options(), str(tmp_path))
    assert backend.dtype == torch.float32 and backend.config.vocab_size == 300
    prompt_text = "héllo wörld"
    prompt_ids = tokenizer.encode(prompt_text).ids
    backend.add(GenerationRequest("text", prompt_text, max_tokens=12, temperature=0.0))
    outputs = _collect(backend)
    assert [t for o in outputs["text"] for t in o.new_tokens] == hf_greedy(reference, prompt_ids, 12)
    generated = [t for o in outputs["text"] for t in o.new_tokens]
    assert "".join(o.text for o in outputs["text"]) == tokenizer.decode(generated)


def test_transformers_4_config_layout_loads(tmp_path: Path) -> None:
    """rope_theta / rope_scaling / torch_dtype (4.x) give the same model as rope_parameters / dtype (5.x)."""
    config = tiny(rope=LLAMA3_ROPE)
    weights = random_weights(config, seed=5)
    v5 = hf_config(config)
    v4 = {key: value for key, value in v5.items() if key not in ("rope_parameters", "dtype")}
    rope = dict(v5["rope_parameters"])
    v4["rope_theta"] = rope.pop("rope_theta")
    v4["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    v4["torch_dtype"] = "float32"
    assert read_hf_config(v4) == read_hf_config(v5 | {"dtype": "float32"})
    _write_checkpoint(tmp_path, v4, weights)
    backend = TorchBackend(engine_options(), str(tmp_path))
    backend.add(GenerationRequest("r", PROMPTS[0], max_tokens=10, temperature=0.0))
    assert _run(backend)["r"] == hf_greedy(hf_model(config, weights), PROMPTS[0], 10)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"type": "dynamic", "factor": 2.0},
        {"rope_type": "longrope"},
    ],
)
def test_an_unimplemented_rope_type_is_refused_at_load(tmp_path: Path, rope_scaling: dict[str, object]) -> None:
    config = hf_config(tiny()) | {"rope_scaling": rope_scaling}
    del config["rope_parameters"]
    _write_checkpoint(tmp_path, config, random_weights(tiny(), seed=0))
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    with pytest.raises(ValueError, match=f"rope type '{kind}' is not implemented"):
        TorchBackend(engine_options(), str(tmp_path))


def _write_checkpoint(path: Path, config: dict[str, object], weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(path / "model.safetensors"))


def _step(backend: TorchBackend) -> list:
    return backend._step()


def _collect(backend: TorchBackend) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while backend.has_work():
        for output in _step(backend):
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def _run(backend: TorchBackend) -> dict[str, list[int]]:
    return {rid: [t for o in outs for t in o.new_tokens] for rid, outs in _collect(backend).items()}
