"""The torch backend's parts on their own, composed without ``TorchBackend``: the request table
(requests, scheduler, lock), the model runner (model, cache) and the step phases over them.

The model is a test double that counts: each row's next token is its last input id plus one,
so every expected output is known without a reference model, and a decode row that fed a wrong
id (a placeholder not resolved from the step in flight) shows at once."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from engines.backend import GenerationRequest, TokenOutput
from engines.torch_backend.block_manager import BlockManager
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.kernels import EAGER
from engines.torch_backend.memory import cache_shape
from engines.torch_backend.model import DecoderModel
from engines.torch_backend.model_runner import ModelRunner
from engines.torch_backend.request_state import RequestState
from engines.torch_backend.request_table import RequestTable
from engines.torch_backend.scheduler import Scheduler
from engines.torch_backend.sequence import PLACEHOLDER, Sequence
from engines.torch_backend.step_phases import StepPhases
from engines.torch_backend.tokenizer import ByteTokenizer, IncrementalDetokenizer
from service.protocol.errors import ErrorCode, WireError

CONFIG = ModelConfig()
EOS = 0
PAGES, BLOCK, CONTEXT = 24, 4, 64


class CountingModel(torch.nn.Module):
    """Test double of the model: logits that make each row's next token its last input id + 1."""

    def __init__(self) -> None:
        super().__init__()
        self.config = CONFIG
        self.kernels = EAGER

    def forward(self, batch: Any, rotary: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        last = batch.input_ids[batch.last_token_index]
        return torch.nn.functional.one_hot((last + 1) % CONFIG.vocab_size, CONFIG.vocab_size).float()


def state(request: GenerationRequest) -> RequestState:
    prompt = list(request.prompt)
    sequence = Sequence.from_prompt(request.request_id, cast(list[int], prompt), limit=CONTEXT)
    return RequestState(request, sequence, 0, IncrementalDetokenizer(ByteTokenizer(), cast(list[int], prompt)))


def parts(launches_ahead: bool) -> tuple[RequestTable, ModelRunner, StepPhases]:
    table = RequestTable(Scheduler(BlockManager(PAGES, BLOCK, True), max_batch=4, max_prefill_tokens=64))
    runner = ModelRunner(
        cast(DecoderModel, CountingModel()),
        torch.zeros(CONTEXT, 2, CONFIG.head_dim),
        torch.zeros(cache_shape(CONFIG, PAGES, BLOCK)),
        [],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_batch=4,
        max_context=CONTEXT,
        block_size=BLOCK,
        cuda_graphs=True,  # asked for, but not on CPU: decode runs eagerly
    )
    return table, runner, StepPhases(table, runner, (EOS,), CONTEXT, launches_ahead)


def greedy(request_id: str, prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, max_tokens=max_tokens, temperature=0.0)


def run(steps: StepPhases) -> dict[str, list[TokenOutput]]:
    outputs: dict[str, list[TokenOutput]] = {}
    while steps.has_work():
        for output in steps.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


@pytest.mark.parametrize("launches_ahead", [False, True])
def test_composed_phases_feed_each_sampled_token_and_finish_by_length_and_eos(launches_ahead: bool) -> None:
    table, runner, steps = parts(launches_ahead)
    assert runner.graphs is None and runner.path.device == "cpu" and not runner.path.cuda_graphs
    table.add(state(greedy("counts", [10, 11, 12], max_tokens=6)))
    table.add(state(greedy("wraps", [250, 251, 252], max_tokens=20)))  # 253, 254, 255, then EOS
    outputs = run(steps)
    assert [o.new_tokens[0] for o in outputs["counts"]] == [13, 14, 15, 16, 17, 18]
    assert outputs["counts"][-1].finish_reason == "length"
    assert [o.new_tokens[0] for o in outputs["wraps"]] == [253, 254, 255, EOS]
    assert outputs["wraps"][-1].finish_reason == "stop"
    blocks = table.scheduler.blocks
    assert len(table) == 0 and blocks.num_free == blocks.num_blocks and steps.in_flight is None


def test_a_dropped_step_in_flight_is_sampled_again_after_the_cache_is_dropped() -> None:
    """What a weight swap does: the step launched ahead is forgotten, the cache dropped, and the
    requests recomputed from their written tokens, to the same outputs."""
    table, _, steps = parts(launches_ahead=True)
    table.add(state(greedy("r", [40, 41], max_tokens=8)))
    first = steps.step() + steps.step()
    launched = steps.in_flight
    assert launched is not None and launched.states[0].sequence.token_ids[-1] == PLACEHOLDER
    steps.drop_launched()
    table.drop_cache()
    assert steps.in_flight is None and PLACEHOLDER not in launched.states[0].sequence.token_ids
    rest = run(steps)["r"]
    assert [o.new_tokens[0] for o in first + rest] == list(range(42, 50))


def test_a_released_runner_steps_nothing_and_resumes_where_it_stopped() -> None:
    table, runner, steps = parts(launches_ahead=False)
    table.add(state(greedy("r", [5], max_tokens=5)))
    first = steps.step()
    table.drop_cache()
    runner.release()
    assert runner.kv_cache is None and steps.step() == [] and steps.has_work()
    runner.restore()
    assert runner.kv_cache is not None
    assert [o.new_tokens[0] for o in first + run(steps)["r"]] == [6, 7, 8, 9, 10]


def test_the_request_table_refuses_a_running_id_and_aborts_once() -> None:
    table, _, _ = parts(launches_ahead=False)
    blocks = table.scheduler.blocks
    table.add(state(greedy("a", [1, 2, 3], max_tokens=4)))
    with pytest.raises(WireError) as conflict:
        table.add(state(greedy("a", [4], max_tokens=4)))
    assert conflict.value.code == ErrorCode.CONFLICT and len(table) == 1
    assert table.abort("a") and not table.abort("a")
    assert len(table) == 0 and not table.has_work() and blocks.num_free == blocks.num_blocks


def test_the_request_table_gives_each_rows_request_and_whether_all_are_greedy() -> None:
    table, _, _ = parts(launches_ahead=False)
    greedy_state, sampled_state = state(greedy("g", [1], 4)), state(GenerationRequest("s", [2], max_tokens=4, seed=1))
    table.add(greedy_state)
    table.add(sampled_state)
    with table.lock:
        assert table.states([greedy_state.sequence]) == ([greedy_state], True)
        assert table.states([greedy_state.sequence, sampled_state.sequence]) == ([greedy_state, sampled_state], False)
        table.finish(sampled_state)
        table.finish(sampled_state)  # already finished: nothing more
    assert len(table) == 1 and table.resumed_text("g") == ""
    table.clear()
    assert len(table) == 0 and not table.has_work()
