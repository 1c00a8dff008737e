"""The fast path named and guarded, on CPU: the path an engine runs is in its status and its
metrics, ``require_fast_path`` refuses to start where any piece is off, a failed graph capture
is logged with its traceback and counted instead of killing the engine, and the compiled
element-wise pieces are compiled at load time in exactly the variants serving runs (no
recompile afterwards, which is what keeps a process inside dynamo's recompile limit)."""

from __future__ import annotations

import logging

import pytest
import torch

from engines.backend import ExecutionPath
from engines.factory import torch_options
from engines.metrics import execution_path_families
from engines.observability import engine_status
from engines.runtime import EngineRuntime
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.batch import build_batch
from engines.torch_backend.config import MoeConfig
from engines.torch_backend.experts import grouped_experts
from engines.torch_backend.fast_path import FastPathUnavailable, capture_graphs, execution_path, require_fast
from engines.torch_backend.kernels import EAGER, Kernels, compiled_pointwise
from engines.torch_backend.rope import rotary_table
from engines.torch_backend.scheduler import ScheduledBatch
from engines.torch_backend.sequence import Sequence
from engines.torch_backend.setup import check_pointwise
from service.ops.settings import Settings
from tests.torch.reference import engine_model, engine_options, random_weights, record_token, tiny

FAST = ExecutionPath("cuda", cuda_graphs=True, paged_kernel=True, compiled=True)


def test_the_path_names_every_piece_and_what_failed() -> None:
    assert FAST.fast and FAST.missing() == []
    assert FAST.describe() == "cuda: graphs on, paged kernel on, compiled on"
    slow = ExecutionPath("cuda", False, True, False, failures=("CUDA graphs",))
    assert not slow.fast
    assert slow.missing() == ["CUDA graphs", "compiled pieces"]
    assert slow.describe() == "cuda: graphs off, paged kernel on, compiled off (failed: CUDA graphs)"
    require_fast(FAST)
    with pytest.raises(FastPathUnavailable, match="CUDA graphs, compiled pieces are off"):
        require_fast(slow)


def test_a_cpu_engine_says_it_runs_no_fast_piece_in_its_status_and_metrics() -> None:
    backend = TorchBackend(engine_options())
    path = backend.execution_path()
    assert path == ExecutionPath("cpu", False, False, False)
    status = engine_status(EngineRuntime(Settings(engine_id="e-path"), backend))
    assert status.execution_path == "cpu: graphs off, paged kernel off, compiled off"
    assert status.fast_path_failures == 0
    families = {family.name: family for family in execution_path_families(path)}
    pieces = {sample.labels["piece"]: sample.value for sample in families["dpcoord_engine_fast_path"].samples}
    assert pieces == {"cuda_graphs": 0.0, "paged_kernel": 0.0, "compiled": 0.0}


def test_require_fast_path_refuses_to_start_on_cpu() -> None:
    with pytest.raises(FastPathUnavailable, match="require_fast_path is set, but CUDA graphs, paged kernel"):
        TorchBackend(engine_options(require_fast_path=True))


def test_the_setting_reaches_the_backend_options() -> None:
    assert torch_options(Settings(require_fast_path=True)).require_fast_path
    assert not torch_options(Settings()).require_fast_path


def test_a_failed_capture_is_logged_with_its_traceback_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """DecodeGraphs refuses a model without the paged kernel: a real capture failure, guarded."""
    config = tiny()
    model = engine_model(config, random_weights(config, seed=3))
    rotary = rotary_table(config.rope, config.head_dim, 64, torch.float32, torch.device("cpu"))
    cache = torch.zeros(config.num_layers, 9, 4, 2, config.num_kv_heads, config.head_dim)
    failures: list[str] = []
    with caplog.at_level(logging.ERROR, logger="engines.torch_backend.fast_path"):
        graphs = capture_graphs(model, rotary, cache, 4, 4, 4, failures)
    assert graphs is None
    assert failures == ["CUDA graphs"]
    (record,) = caplog.records
    assert record.exc_info is not None and "paged decode kernel" in str(record.exc_info[1])
    path = execution_path(torch.device("cuda"), EAGER, graphs is not None, failures)
    assert path.failures == ("CUDA graphs",) and not path.cuda_graphs


SERVED = {
    "llama": tiny(),
    # Head norms on views of the fused q|k|v rows (3-d inputs); grouped experts of another width.
    "qwen3-moe": tiny(
        family="qwen3_moe", head_dim=24, qk_norm=True, moe=MoeConfig(8, 2, 32, mlp_only_layers=(1,)), num_layers=3
    ),
}


@pytest.mark.parametrize("name", list(SERVED))
def test_serving_never_recompiles_the_pieces_the_load_time_check_compiled(name: str) -> None:
    """The check compiles under inference_mode with several tokens and with one; a prefill and
    decode steps at batch 1 and 3 then run every compiled piece without a new variant
    (``error_on_recompile`` turns one into an error). ``aot_eager`` traces what inductor would."""
    config = SERVED[name]
    model = engine_model(config, random_weights(config, seed=4))
    model.kernels = Kernels(*compiled_pointwise("aot_eager"), None, grouped_experts)
    rotary = rotary_table(config.rope, config.head_dim, 128, torch.float32, torch.device("cpu"))
    check_pointwise(model.kernels, config, rotary)
    block_size = 4
    cache = torch.zeros(config.num_layers, 40, block_size, 2, config.num_kv_heads, config.head_dim)
    sequences = [Sequence.from_prompt(str(i), [(7 * i + k) % 256 for k in range(3 + 2 * i)]) for i in range(3)]
    page = 0
    for sequence in sequences:
        count = -(-(len(sequence.token_ids) + 4) // block_size)
        sequence.block_table = list(range(page, page + count))
        page += count

    def forward(decode: list[Sequence], prefill: list[Sequence]) -> list[int]:
        batch = build_batch(
            ScheduledBatch(decode, prefill), block_size, config.group_size, torch.float32, torch.device("cpu")
        )
        return model(batch, rotary, cache).argmax(dim=-1).tolist()

    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for sequence, token in zip(sequences, forward([], sequences), strict=True):
            record_token(sequence, token)
        for chosen in (sequences[:1], sequences, sequences[:1]):
            for sequence, token in zip(chosen, forward(chosen, []), strict=True):
                record_token(sequence, token)
