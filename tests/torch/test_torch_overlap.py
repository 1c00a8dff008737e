"""The overlap scheduler on CPU: step n + 1 is scheduled and launched before step n's sampled
ids are read back, its decode rows' input ids resolved on the device from step n's output;
decisions that need the token (EOS, stop strings) are applied one step late, and the extra
token they leave in flight is never emitted. Outputs equal steps run one at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engines.backend import GenerationRequest, TokenOutput
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.memory import page_bytes
from engines.torch_backend.sequence import PLACEHOLDER
from tests.torch.reference import engine_options, run_to_end

SEED = 7


class RecordingModel(torch.nn.Module):
    """Test double around the real model: records the input ids each forward pass is given."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.kernels = inner.kernels
        self.fed: list[list[int]] = []

    def forward(self, batch: Any, rotary: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        self.fed.append(batch.input_ids.tolist())
        return self.inner(batch, rotary, cache)


def test_the_next_step_is_launched_before_this_one_is_read_and_feeds_its_tokens() -> None:
    backend = TorchBackend(engine_options(model_seed=SEED, overlap_steps=True))
    model = RecordingModel(backend.model)
    backend.runner.model = model  # type: ignore[assignment]
    order: list[str] = []

    def recorded(name: str) -> Callable[..., Any]:
        method = getattr(backend.steps, name)

        def call(*args: Any) -> Any:
            order.append(name)
            return method(*args)

        return call

    for name in ("_launch", "_collect"):
        setattr(backend.steps, name, recorded(name))
    for index in range(3):
        backend.add(GenerationRequest(f"r{index}", [index + 1, 2, 3], max_tokens=6, temperature=0.0))
    emitted: list[list[int]] = []
    while backend.has_work():
        outputs = backend._step()
        if outputs:
            emitted.append([token for output in outputs for token in output.new_tokens])
        launched = backend.steps.in_flight
        if launched is not None:  # in flight: the host knows its tokens only as placeholders
            assert all(state.sequence.token_ids[-1] == PLACEHOLDER for state in launched.states)
    assert order[:4] == ["_launch", "_launch", "_collect", "_launch"]  # step 2 launched before step 1 is read
    # Step k + 1 fed what step k sampled, though the host launched it before reading them.
    decode_fed = model.fed[1:]
    assert [fed for fed in decode_fed[: len(emitted) - 1]] == emitted[:-1]
    assert [len(tokens) for tokens in emitted] == [3] * 6


def test_a_stop_string_ends_a_request_one_step_late_without_emitting_the_extra_token() -> None:
    plain = TorchBackend(engine_options(model_seed=SEED, overlap_steps=False))
    free = "".join(
        output.text for output in run_to_end(plain, GenerationRequest("f", "abc", max_tokens=20, seed=1))["f"]
    )
    stop = free[6:8]
    request = GenerationRequest("s", "abc", max_tokens=20, seed=1, stop=(stop,))
    expected = run_to_end(plain, request)["s"]
    overlapped = TorchBackend(engine_options(model_seed=SEED, overlap_steps=True))
    overlapped.add(request)
    got: list[TokenOutput] = []
    in_flight_after_stop = False
    while overlapped.has_work():
        step = overlapped._step()
        got += step
        if any(output.finish_reason == "stop" for output in step):
            launched = overlapped.steps.in_flight
            in_flight_after_stop = launched is not None and any(
                state.request.request_id == "s" for state in launched.states
            )
    assert got == expected and got[-1].finish_reason == "stop"
    assert in_flight_after_stop  # the next step had its row, whose token was dropped
    blocks = overlapped.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


def test_seeded_sampling_with_preemption_and_arrivals_is_the_same_launched_ahead() -> None:
    pages = 10
    budget = pages * page_bytes(ModelConfig(), 4, torch.float32) / (1 << 30)

    def staggered(overlap: bool) -> tuple[dict[str, list[TokenOutput]], int]:
        options = engine_options(
            model_seed=SEED, kv_block_size=4, max_context=64, kv_cache_gb=budget, overlap_steps=overlap
        )
        backend = TorchBackend(options)
        pending = [
            GenerationRequest(f"q{i}", [(5 * i + k) % 256 for k in range(3 + i)], max_tokens=10 + i, seed=i, top_k=40)
            for i in range(8)
        ]
        outputs: dict[str, list[TokenOutput]] = {}
        while pending or backend.has_work():
            if pending:
                backend.add(pending.pop(0))
            for output in backend._step():
                outputs.setdefault(output.request_id, []).append(output)
        return outputs, backend.scheduler.num_preempted

    expected, _ = staggered(False)
    got, preempted = staggered(True)
    assert got == expected and preempted > 0
    assert staggered(True)[0] == got
