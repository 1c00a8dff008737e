"""Shared pieces of the torch tests: tiny configs, transformers' reference model of the same
family with the same weights, and a harness that drives the engine's model step by step."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.torch_backend.batch import build_batch
from engines.torch_backend.block_manager import BlockManager
from engines.torch_backend.config import ModelConfig, RopeConfig
from engines.torch_backend.families import hf_config
from engines.torch_backend.model import DecoderModel
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.rope import rotary_table
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import Sequence
from engines.torch_backend.weights import build_model, random_weights

TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def tiny(**changes: Any) -> ModelConfig:
    return dataclasses.replace(TINY, **changes)


LLAMA3_ROPE = RopeConfig(
    theta=500000.0,
    type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor]) -> Any:
    """transformers' causal LM of the config's family holding ``weights`` (Hugging Face names),
    loaded by ``from_pretrained`` from a checkpoint written here, so that transformers maps
    the names itself (per-expert tensors onto its stacked experts, for one)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(hf_config(config)))
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, f"{directory}/model.safetensors")
        model = AutoModelForCausalLM.from_pretrained(directory)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def record_token(sequence: Sequence, token: int, blocks: BlockManager | None = None) -> None:
    """What a step without the backend records of a sampled token: every token fed before it is
    now cached (the engine writes it over its placeholder instead, ``StepPhases._collect``);
    with ``blocks``, the pages it filled join the prefix cache."""
    sequence.num_cached = len(sequence.token_ids)
    sequence.token_ids.append(token)
    if blocks is not None and sequence.num_cached >= (sequence.num_committed + 1) * blocks.block_size:
        blocks.commit(sequence)


def engine_model(config: ModelConfig, weights: dict[str, torch.Tensor]) -> DecoderModel:
    return build_model(config, iter(weights.items()), torch.float32, torch.device("cpu"))


def engine_options(**overrides: Any) -> TorchOptions:
    """Backend options for tests: a small KV cache and context, so each backend starts fast."""
    return dataclasses.replace(TorchOptions(device="cpu", max_context=256, kv_cache_gb=0.01, max_batch=16), **overrides)


class Harness:
    """The engine's model, scheduler and cache without the backend: feeds chosen tokens and
    returns the logits of every step, so prefill and decode can be compared with transformers."""

    def __init__(self, model: DecoderModel, num_blocks: int = 64, block_size: int = 4, max_batch: int = 16) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        self.scheduler = Scheduler(
            BlockManager(num_blocks, block_size, prefix_caching=False), max_batch, max_prefill_tokens=4096
        )
        self.cache = torch.zeros(config.num_layers, num_blocks, block_size, 2, config.num_kv_heads, config.head_dim)
        self.rotary = rotary_table(
            config.rope, config.head_dim, config.max_position_embeddings, torch.float32, torch.device("cpu")
        )

    @torch.inference_mode()
    def step(self) -> dict[str, torch.Tensor]:
        scheduled = self.scheduler.schedule()
        batch = build_batch(
            scheduled,
            self.block_size,
            self.model.config.group_size,
            torch.float32,
            torch.device("cpu"),
            sliding_window=self.model.config.sliding_window,
        )
        logits = self.model(batch, self.rotary, self.cache)
        return {sequence.request_id: row for sequence, row in zip(scheduled.sequences, logits, strict=True)}

    def forced_logits(self, sequences: dict[str, tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        """For each id: prefill ``prompt``, then feed ``continuation`` one token per step.
        Returns ``[1 + len(continuation), vocab]`` logits: after the prompt, then after each token."""
        states = {rid: Sequence.from_prompt(rid, prompt) for rid, (prompt, _) in sequences.items()}
        for state in states.values():
            self.scheduler.add(state)
        collected: dict[str, list[torch.Tensor]] = {rid: [] for rid in sequences}
        while any(len(collected[rid]) <= len(sequences[rid][1]) for rid in sequences):
            for rid, logits in self.step().items():
                collected[rid].append(logits)
                fed = len(collected[rid]) - 1
                continuation = sequences[rid][1]
                if fed < len(continuation):
                    record_token(states[rid], continuation[fed])
                else:
                    self.scheduler.remove(states[rid])
        return {rid: torch.stack(rows) for rid, rows in collected.items()}


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


__all__ = [
    "LLAMA3_ROPE",
    "TINY",
    "Harness",
    "engine_model",
    "engine_options",
    "hf_greedy",
    "hf_model",
    "random_weights",
    "tiny",
]


def run_to_end(backend: Any, *requests: Any) -> dict[str, list[Any]]:
    """Add ``requests`` to a TorchBackend and step it until it has no work: each request's
    outputs (TokenOutput), in order."""
    for request in requests:
        backend.add(request)
    outputs: dict[str, list[Any]] = {}
    while backend.has_work():
        for output in backend._step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs
