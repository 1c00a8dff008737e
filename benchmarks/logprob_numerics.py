"""How exact the torch engine's log-probabilities are, on CPU in float32 with a tiny random Llama
(the built-in random model: 4 layers, hidden 256, a 256-token byte vocabulary).

    python -m benchmarks.logprob_numerics [--prompts 8] [--tokens 64] [--batch 64] [--json]

An RL trainer recomputes the sampled tokens' logprobs with its own forward pass over the whole
sequence and compares them with the engine's (importance ratios): the figure that matters is how
far apart the two are. Three figures, each the greatest absolute difference over every
generated token of ``--prompts`` greedy requests of ``--tokens`` tokens:

- **vs transformers**: the engine's greedy token logprobs (prefill, then paged decode steps)
  against ``log_softmax`` of transformers' ``LlamaForCausalLM`` logits from one forward pass over
  prompt + generated tokens, with the same weights (the trainer's view); prompt logprobs too;
- **alone vs in a batch**: each request run alone against the same request inside a batch of
  ``--batch`` (the others random prompts of random lengths, arriving together);
- **migrated**: each request resumed halfway on a second engine (a prefill of the prompt and the
  delivered tokens), its later tokens' logprobs against the uninterrupted run's.

The target is 1e-4 for each. Where batch composition moves a figure, it comes from the forward
pass, not the logprob code (a log-softmax per row): CPU matrix products pick their blocking by
the number of rows, so a row's logits differ in the last bits with the rows around it; the
logprobs inherit that. One process, one torch thread unless ``--threads``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.backend import GenerationRequest, TokenOutput
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families import hf_config
from engines.torch_backend.options import TorchOptions
from engines.torch_backend.weights import random_weights

TARGET = 1e-4
SEED = 17


@dataclass
class Run:
    tokens: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float | None]


def backend() -> TorchBackend:
    options = TorchOptions(device="cpu", max_context=512, kv_cache_gb=0.05, max_batch=128, model_seed=SEED)
    return TorchBackend(options)


def run(engine: TorchBackend, requests: list[GenerationRequest]) -> dict[str, Run]:
    """Add every request at once and step until done: each one's tokens and logprobs."""
    for request in requests:
        engine.add(request)
    outputs: dict[str, list[TokenOutput]] = {request.request_id: [] for request in requests}
    while engine.has_work():
        for output in engine._step():
            outputs[output.request_id].append(output)
    runs = {}
    for request_id, produced in outputs.items():
        prompt = next((output.prompt for output in produced if output.prompt is not None), None)
        runs[request_id] = Run(
            [token for output in produced for token in output.new_tokens],
            [value for output in produced for value in output.logprobs or ()],
            prompt.logprobs if prompt is not None else [],
        )
    return runs


def greedy(request_id: str, prompt: list[int], tokens: int, **fields: Any) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, max_tokens=tokens, temperature=0.0, logprobs=1, **fields)


def transformers_logprobs(prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """transformers' logprobs of ``tokens`` after ``prompt``, and of the prompt's tokens after the
    first, from one forward pass over the whole sequence."""
    global _reference
    if _reference is None:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        config = ModelConfig()
        with tempfile.TemporaryDirectory() as directory:  # transformers maps the names itself
            (Path(directory) / "config.json").write_text(json.dumps(hf_config(config)))
            weights = random_weights(config, seed=SEED)
            save_file({name: tensor.contiguous() for name, tensor in weights.items()}, f"{directory}/model.safetensors")
            _reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    sequence = prompt + tokens
    with torch.inference_mode():
        logprobs = torch.log_softmax(_reference(torch.tensor([sequence])).logits[0].float(), dim=-1)
    rows = [logprobs[p - 1, sequence[p]].item() for p in range(1, len(sequence))]
    return rows[len(prompt) - 1 :], rows[: len(prompt) - 1]


_reference: Any = None


def worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def measure(prompts: int, tokens: int, batch: int) -> dict[str, float]:
    rng = random.Random(SEED)
    cases = {f"r{i}": [rng.randrange(256) for _ in range(rng.randrange(4, 40))] for i in range(prompts)}
    engine, other = backend(), backend()
    alone = {}
    for request_id, prompt in cases.items():
        alone.update(run(engine, [greedy(request_id, prompt, tokens, prompt_logprobs=0)]))
    versus = prompt_versus = 0.0
    for request_id, prompt in cases.items():
        generated, prompt_side = transformers_logprobs(prompt, alone[request_id].tokens)
        versus = max(versus, worst(alone[request_id].logprobs, generated))
        engine_prompt = [value for value in alone[request_id].prompt_logprobs[1:] if value is not None]
        prompt_versus = max(prompt_versus, worst(engine_prompt, prompt_side))
    in_batch = 0.0
    for request_id, prompt in cases.items():
        fillers = [
            greedy(f"{request_id}-f{j}", [rng.randrange(256) for _ in range(rng.randrange(4, 40))], tokens)
            for j in range(batch - 1)
        ]
        together = run(engine, [*fillers[: batch // 2], greedy(request_id, prompt, tokens), *fillers[batch // 2 :]])
        assert together[request_id].tokens == alone[request_id].tokens, f"{request_id}: tokens moved in the batch"
        in_batch = max(in_batch, worst(together[request_id].logprobs, alone[request_id].logprobs))
    migrated = 0.0
    cut = tokens // 2
    for request_id, prompt in cases.items():
        delivered = tuple(alone[request_id].tokens[:cut])
        resumed = run(other, [greedy(request_id, prompt, tokens, resume_tokens=delivered)])[request_id]
        assert resumed.tokens == alone[request_id].tokens[cut:], f"{request_id}: the resumed run's tokens moved"
        migrated = max(migrated, worst(resumed.logprobs, alone[request_id].logprobs[cut:]))
    return {
        "vs_transformers": versus,
        "prompt_vs_transformers": prompt_versus,
        "alone_vs_batch": in_batch,
        "migrated_vs_uninterrupted": migrated,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    figures = measure(args.prompts, args.tokens, args.batch)
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"logprob numerics, CPU float32, {args.prompts} greedy requests x {args.tokens} tokens, target {TARGET:g}"
        )
        for name, value in figures.items():
            print(f"  {name:<28} max |diff| {value:.3e}  {'ok' if value <= TARGET else 'OVER TARGET'}")
    return 0 if all(value <= TARGET for value in figures.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
