"""What the engine benchmarks run and time: the torch backend in-process, transformers'
``generate`` one request at a time and as a static batch, the shared-prefix workload, and the
memory-bandwidth floor of a decode step."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.backend import GenerationRequest
from engines.torch_backend.backend import TorchBackend


@dataclass
class EngineRun:
    """One batch of requests through the engine, added together and stepped until all finished."""

    requests: int
    generated: int
    wall: float
    cpu: float  # this process's CPU seconds: the engine's Python and its kernel launches
    steps: int
    decode_steps: list[float] = field(default_factory=list)  # seconds of the steps in which no request started
    first_token: list[float] = field(default_factory=list)  # seconds from the start to each request's first token

    @property
    def rate(self) -> float:
        return self.generated / self.wall

    @property
    def cpu_rate(self) -> float:
        return self.generated / self.cpu if self.cpu > 0 else float("inf")

    @property
    def decode_step_ms(self) -> float:
        return 1000 * statistics.median(self.decode_steps) if self.decode_steps else float("nan")

    @property
    def ttft_ms(self) -> float:
        return 1000 * statistics.median(self.first_token)

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000 * self.cpu / self.steps


async def run_engine(backend: TorchBackend, requests: list[GenerationRequest]) -> EngineRun:
    started, cpu_started = time.perf_counter(), time.process_time()
    for request in requests:
        backend.add(request)
    first: dict[str, float] = {}
    decode_steps: list[float] = []
    generated = steps = 0
    while backend.has_work():
        step_started = time.perf_counter()
        outputs = await backend.step()
        now = time.perf_counter()
        steps += 1
        starting = [output.request_id for output in outputs if output.request_id not in first]
        for request_id in starting:
            first[request_id] = now - started
        if outputs and not starting:
            decode_steps.append(now - step_started)
        generated += sum(len(output.new_tokens) for output in outputs)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    expected = sum(request.max_tokens for request in requests)
    if generated != expected:
        raise RuntimeError(f"the engine generated {generated} tokens, expected {expected}")
    return EngineRun(len(requests), generated, wall, cpu, steps, decode_steps, list(first.values()))


def text_prompts(count: int, length: int) -> list[str]:
    base = "the engine batches requests, the baseline runs them one by one "
    return [(f"request {i}: " + base * (1 + length // len(base)))[:length] for i in range(count)]


def greedy_requests(
    tag: str, prompts: Sequence[str | list[int]], max_tokens: int, logprobs: int | None = None
) -> list[GenerationRequest]:
    """``logprobs``: each request asks for its tokens' log-probabilities with that many alternatives."""
    return [
        GenerationRequest(f"{tag}-{i}", prompt, max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
        for i, prompt in enumerate(prompts)
    ]


def shared_prefix_prompts(count: int, prefix_tokens: int, own_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts: one system prompt of ``prefix_tokens`` ids, then ``own_tokens`` of each's own."""
    draw = random.Random(seed)
    top = min(vocab, 32000)
    prefix = [draw.randrange(top) for _ in range(prefix_tokens)]
    return [prefix + [draw.randrange(top) for _ in range(own_tokens)] for _ in range(count)]


def generate_one_at_a_time(
    model: Any, backend: TorchBackend, prompts: list[str], max_tokens: int
) -> tuple[int, float, float]:
    """transformers ``generate``, one request at a time: (tokens, wall s, CPU s)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    generated = 0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([backend.tokenizer.encode(prompt)], device=backend.device)
            generated += _generate(model, ids, max_tokens).shape[1] - ids.shape[1]
    _sync(backend.device)
    return generated, time.perf_counter() - started, time.process_time() - cpu_started


def generate_static_batch(
    model: Any, backend: TorchBackend, prompts: list[str], max_tokens: int
) -> tuple[int, float, float]:
    """transformers ``generate`` on all prompts at once (they have the same length): (tokens, wall s, CPU s)."""
    ids = torch.tensor([backend.tokenizer.encode(prompt) for prompt in prompts], device=backend.device)
    started, cpu_started = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = _generate(model, ids, max_tokens)
    _sync(backend.device)
    return out[:, ids.shape[1] :].numel(), time.perf_counter() - started, time.process_time() - cpu_started


def _generate(model: Any, ids: torch.Tensor, max_tokens: int) -> torch.Tensor:
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a large on-device copy reads and writes: what a decode step can stream."""
    size = (1 << 30) if device.type == "cuda" else (1 << 27)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    _sync(device)
    rounds = 10
    started = time.perf_counter()
    for _ in range(rounds):
        target.copy_(source)
    _sync(device)
    return 2 * size * rounds / (time.perf_counter() - started)


# HBM bandwidth the vendor states, by a fragment of torch.cuda.get_device_name().
NOMINAL_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 80GB HBM3": 3.35e12,
    "H100 PCIe": 2.0e12,
    "A100-SXM4-80GB": 2.04e12,
}


def nominal_bandwidth(device: torch.device) -> tuple[str, float] | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next(((name, value) for fragment, value in NOMINAL_BANDWIDTH.items() if fragment in name), None)
