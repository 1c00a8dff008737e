"""What some families add, piece by piece, on CPU: each family's chat template style rendered
by the engine as transformers renders it; Mistral's sliding window (and Qwen3-MoE's, in every
layer) against transformers' logits through prefill and decode over the paged cache;
Qwen3-MoE's grouped experts (the CUDA form, run here by torch's CPU grouped_mm) against the
per-expert loop, alone and inside the model; and a mixture-of-experts model without grouped
experts named on its path, never silently slow."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.chat_template import message_dicts
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.experts import grouped_experts, loop_experts
from engines.torch_backend.families import read_model_dir
from engines.torch_backend.fast_path import capture_graphs
from engines.torch_backend.kernels import EAGER, Kernels
from engines.torch_backend.rope import rotary_table
from engines.torch_backend.setup import MOE_EAGER, check_experts, checked_cuda_kernels
from engines.torch_backend.weights import build_model, checkpoint_weights
from service.protocol.messages import ChatMessage
from tests.torch.families import FAMILIES, Checkpoints, transformers_model
from tests.torch.reference import Harness, engine_options

CHATML = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES: dict[str, tuple[str, dict[str, str]]] = {
    "llama": (
        "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "qwen2": (CHATML, {"eos_token": "<|im_end|>"}),
    "qwen3": (CHATML, {"eos_token": "<|im_end|>"}),
    "qwen3_moe": (CHATML, {"eos_token": "<|im_end|>"}),
    "mistral": (
        "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
        "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- elif message['role'] == 'assistant' %}"
        "{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}",
        {"bos_token": "<s>", "eos_token": "</s>"},
    ),
}
CONVERSATION = [
    ChatMessage("user", "Héllo, who are you?"),
    ChatMessage("assistant", "An engine."),
    ChatMessage("user", "Stream tokens, please"),
]


def family_tokenizer(family: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, special = TEMPLATES[family]
    extra = ["<|im_start|>", "<|start_header_id|>", "<|end_header_id|>", "[INST]", "[/INST]"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[*special.values(), *extra],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["héllo wörld, the engine streams tokens to the user"] * 20, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, additional_special_tokens=extra, **special)
    wrapped.chat_template = template
    return wrapped


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_chat_template_renders_as_transformers(
    checkpoints: Checkpoints, family: str, tmp_path: Path
) -> None:
    import shutil

    model_dir = tmp_path / family
    shutil.copytree(checkpoints.get(family).path, model_dir)
    tokenizer = family_tokenizer(family)
    tokenizer.save_pretrained(model_dir)
    backend = TorchBackend(engine_options(), str(model_dir))
    expected = tokenizer.apply_chat_template(
        message_dicts(CONVERSATION), tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert backend.render_chat(CONVERSATION) == list(expected)


@pytest.mark.parametrize("family", ["mistral", "qwen3_moe"])
def test_the_sliding_window_gives_transformers_logits_past_the_window(
    checkpoints: Checkpoints, family: str, tmp_path: Path
) -> None:
    """An 8-token window (Mistral's; Qwen3-MoE's with ``use_sliding_window``, in every layer):
    prefill 10 tokens, decode 20 more, in one batch with a sequence shorter than the window;
    without the window the logits differ."""
    if family == "mistral":
        path, reference = checkpoints.get(family).path, checkpoints.get(family).reference
    else:
        path, reference = tmp_path, transformers_model(family, 1, use_sliding_window=True, sliding_window=8)
        reference.save_pretrained(path)
    config = read_model_dir(path)
    assert config.sliding_window == 8
    sequences = {"long": (list(range(40, 50)), list(range(100, 120))), "short": ([9, 8, 7], [6, 5])}
    logits = {}
    for window in (8, None):
        windowed = dataclasses.replace(config, sliding_window=window)
        model = build_model(windowed, checkpoint_weights(path), torch.float32, torch.device("cpu"))
        logits[window] = Harness(model).forced_logits(sequences)
    with torch.inference_mode():
        for rid, (prompt, continuation) in sequences.items():
            tokens = prompt + continuation
            expected = reference(torch.tensor([tokens])).logits[0, len(prompt) - 1 :]
            torch.testing.assert_close(logits[8][rid], expected, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(logits[None]["long"], logits[8]["long"], atol=1e-3)


def routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights, chosen = torch.topk(torch.rand((tokens, experts), generator=generator), k, dim=-1)
    return weights, chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_experts_equal_the_per_expert_loop(dtype: torch.dtype, tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    experts, hidden, width, k = 8, 64, 32, 2
    gate_up = (torch.randn((experts, 2 * width, hidden), generator=generator) * 0.1).to(dtype)
    down = (torch.randn((experts, hidden, width), generator=generator) * 0.1).to(dtype)
    x = torch.randn((tokens, hidden), generator=generator).to(dtype)
    weights, chosen = routing(tokens, experts, k, seed=tokens)
    args = (x, weights.to(dtype), chosen, gate_up, down, EAGER.silu_mul)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped_experts(*args), loop_experts(*args), atol=tolerance, rtol=tolerance)


def test_the_model_with_grouped_experts_gives_the_loop_logits(checkpoints: Checkpoints) -> None:
    path = checkpoints.get("qwen3_moe").path
    config = read_model_dir(path)
    model = build_model(config, checkpoint_weights(path), torch.float32, torch.device("cpu"))
    sequences = {"a": (list(range(20, 45)), [1, 2, 3]), "b": ([7], [8, 9, 10])}
    looped = Harness(model).forced_logits(sequences)
    model.kernels = dataclasses.replace(EAGER, moe_experts=grouped_experts)
    rotary = rotary_table(config.rope, config.head_dim, 64, torch.float32, torch.device("cpu"))
    check_experts(model.kernels, config, rotary)  # the load-time check passes them
    grouped = Harness(model).forced_logits(sequences)
    for rid in sequences:
        torch.testing.assert_close(grouped[rid], looped[rid], atol=1e-5, rtol=1e-5)


def test_experts_that_fail_their_check_are_named_and_keep_decode_out_of_graphs(
    checkpoints: Checkpoints, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = checkpoints.get("qwen3_moe").path
    config = read_model_dir(path)
    model = build_model(config, checkpoint_weights(path), torch.float32, torch.device("cpu"))
    rotary = rotary_table(config.rope, config.head_dim, 64, torch.float32, torch.device("cpu"))

    def broken(*args: object) -> None:
        raise RuntimeError("grouped_mm is not available here")

    monkeypatch.setattr("engines.torch_backend.setup.check_experts", broken)
    with caplog.at_level(logging.ERROR, logger="engines.torch_backend.setup"):
        kernels, failures = checked_cuda_kernels(model, rotary, compile_pointwise=False)
    assert MOE_EAGER in failures and kernels.moe_experts is loop_experts
    assert any("MoE runs eager" in record.getMessage() for record in caplog.records)

    def paged_stand_in(*args: object) -> torch.Tensor:  # a test double: graphs refuse before calling it
        raise AssertionError("not called")

    model.kernels = Kernels(EAGER.rms_norm, EAGER.rotate_, EAGER.silu_mul, paged_stand_in, loop_experts)
    cache = torch.zeros(config.num_layers, 9, 4, 2, config.num_kv_heads, config.head_dim)
    graph_failures: list[str] = []
    assert capture_graphs(model, rotary, cache, 4, 4, 4, graph_failures) is None
    assert graph_failures == ["CUDA graphs"]
