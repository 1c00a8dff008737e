"""The torch backend on its own: sampling, stopping, refusals, queueing, abort, suspend and
resume, the profiler, and cache sizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engines.backend import GenerationRequest, TokenOutput
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families import hf_config
from engines.torch_backend.memory import KVCacheSizeError, page_bytes
from engines.torch_backend.sampling import SamplingParams, request_key, sample
from engines.torch_backend.setup import resolve_dtype
from service.protocol.errors import WireError
from tests.torch.reference import engine_options, random_weights, run_to_end, tiny


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    return TorchBackend(engine_options(model_seed=1))


def tokens(outputs: list[TokenOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_tokens]


def text(outputs: list[TokenOutput]) -> str:
    return "".join(output.text for output in outputs)


def sampled(rid: str, prompt: str = "Once upon a time", **params: object) -> GenerationRequest:
    values: dict[str, object] = {"max_tokens": 20, "temperature": 1.0, "seed": 42}
    values.update(params)
    return GenerationRequest(rid, prompt, **values)  # type: ignore[arg-type]


def test_defaults_without_sampling_params_give_sixteen_tokens(backend: TorchBackend) -> None:
    outputs = run_to_end(backend, GenerationRequest("d", "Hi"))["d"]
    assert len(tokens(outputs)) == 16 and outputs[-1].finish_reason == "length"
    assert all(output.finish_reason is None for output in outputs[:-1])


def test_same_seed_and_prompt_same_tokens_whatever_the_neighbours(backend: TorchBackend) -> None:
    alone = tokens(run_to_end(backend, sampled("alone"))["alone"])
    greedy_alone = tokens(run_to_end(backend, sampled("greedy", temperature=0.0))["greedy"])
    neighbours = [sampled(f"n{i}", prompt="x" * (i + 1), seed=i, top_k=5 * i, top_p=0.5 + i / 20) for i in range(7)]
    crowded = run_to_end(
        backend, *neighbours[:3], sampled("crowded"), sampled("greedy", temperature=0.0), *neighbours[3:]
    )
    assert tokens(crowded["crowded"]) == alone
    assert tokens(crowded["greedy"]) == greedy_alone
    other_seed = tokens(run_to_end(backend, sampled("other", seed=43))["other"])
    assert other_seed != alone


def test_sampling_is_not_greedy_at_temperature_one(backend: TorchBackend) -> None:
    greedy = tokens(run_to_end(backend, sampled("g", temperature=0.0))["g"])
    draws = {tuple(tokens(run_to_end(backend, sampled(f"s{seed}", seed=seed))[f"s{seed}"])) for seed in range(4)}
    assert len(draws) == 4 and tuple(greedy) not in draws


def test_top_k_one_and_a_tiny_top_p_are_greedy(backend: TorchBackend) -> None:
    greedy = tokens(run_to_end(backend, sampled("g", temperature=0.0))["g"])
    assert tokens(run_to_end(backend, sampled("k", top_k=1))["k"]) == greedy
    assert tokens(run_to_end(backend, sampled("p", top_p=1e-6))["p"]) == greedy


def test_sampler_respects_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    rows = logits.shape[0]

    def draw(top_k: int, top_p: float) -> torch.Tensor:
        params = SamplingParams.build(
            [1.0] * rows,
            [top_k] * rows,
            [top_p] * rows,
            [request_key(9)] * rows,
            list(range(rows)),
            torch.device("cpu"),
        )
        return sample(logits, params)

    full = torch.bincount(draw(0, 1.0), minlength=4) / rows
    torch.testing.assert_close(full, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    assert set(draw(2, 1.0).tolist()) == {0, 1}
    assert set(draw(0, 0.75).tolist()) == {0, 1}  # 0.5 < 0.75, 0.8 >= 0.75: two tokens
    assert set(draw(0, 0.5).tolist()) == {0}


def test_stop_string_ends_the_request_and_keeps_the_text(backend: TorchBackend) -> None:
    free = text(run_to_end(backend, sampled("free", max_tokens=30))["free"])
    start = next(i for i in range(5, len(free) - 1) if "\ufffd" not in free[i : i + 2])
    stop = free[start : start + 2]
    outputs = run_to_end(backend, sampled("stopped", max_tokens=30, stop=("never", stop)))["stopped"]
    assert outputs[-1].finish_reason == "stop"
    assert text(outputs) == free[: free.index(stop) + len(stop)]


@pytest.mark.parametrize("overlap", [False, True], ids=["one at a time", "launched ahead"])
def test_max_tokens_and_context_limit(overlap: bool) -> None:
    backend = TorchBackend(engine_options(model_seed=1, overlap_steps=overlap))
    assert len(tokens(run_to_end(backend, sampled("m", max_tokens=3))["m"])) == 3
    prompt = [65] * (backend.max_context - 2)
    outputs = run_to_end(backend, GenerationRequest("c", prompt, max_tokens=50, temperature=0.0))["c"]
    assert len(tokens(outputs)) == 2 and outputs[-1].finish_reason == "length"


@pytest.mark.parametrize("overlap", [False, True], ids=["one at a time", "launched ahead"])
def test_eos_from_generation_config_stops_with_stop(tmp_path: Path, overlap: bool) -> None:
    """Launched ahead, the step after the EOS has a row for it, whose token is never emitted."""
    config = tiny()
    weights = random_weights(config, seed=2)
    _checkpoint(tmp_path, hf_config(config), weights)
    free = TorchBackend(engine_options(), str(tmp_path))
    generated = tokens(run_to_end(free, GenerationRequest("r", [1, 2, 3], max_tokens=12, temperature=0.0))["r"])
    eos = generated[4]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [999, eos]}))
    backend = TorchBackend(engine_options(overlap_steps=overlap), str(tmp_path))
    assert backend.config.eos_token_ids == (999, eos)
    outputs = run_to_end(backend, GenerationRequest("r", [1, 2, 3], max_tokens=12, temperature=0.0))["r"]
    assert tokens(outputs) == generated[: generated.index(eos) + 1]
    assert outputs[-1].finish_reason == "stop"
    blocks = backend.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks


def test_eos_null_means_no_eos(tmp_path: Path) -> None:
    config = tiny()
    _checkpoint(tmp_path, hf_config(config) | {"eos_token_id": 5}, random_weights(config, seed=2))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert TorchBackend(engine_options(), str(tmp_path)).config.eos_token_ids == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({}))
    assert TorchBackend(engine_options(), str(tmp_path)).config.eos_token_ids == (5,)


def test_refusals(backend: TorchBackend) -> None:
    with pytest.raises(WireError) as outside:
        backend.add(GenerationRequest("v", [1, 256]))
    assert outside.value.code == 400 and "256" in outside.value.message
    with pytest.raises(WireError) as empty:
        backend.add(GenerationRequest("e", ""))
    assert empty.value.code == 400
    with pytest.raises(WireError) as long:
        backend.add(GenerationRequest("l", "x" * backend.max_context))
    assert long.value.code == 413 and str(backend.max_context) in long.value.message
    assert not backend.has_work()


@pytest.mark.parametrize("overlap", [False, True], ids=["one at a time", "launched ahead"])
def test_a_full_cache_queues_requests_and_serves_them_all(overlap: bool) -> None:
    """Launched ahead, a preempted request drops the token of the step in flight and samples it again."""
    pages = 6  # 24 token slots: two 10-token requests at most
    budget = pages * page_bytes(ModelConfig(), 4, torch.float32) / (1 << 30)
    backend = TorchBackend(engine_options(kv_block_size=4, max_context=64, kv_cache_gb=budget, overlap_steps=overlap))
    assert backend.scheduler.blocks.num_blocks == pages
    requests = [GenerationRequest(f"q{i}", "abcdefgh", max_tokens=12, temperature=0.0) for i in range(5)]
    outputs = run_to_end(backend, *requests)
    assert sorted(outputs) == [f"q{i}" for i in range(5)]
    assert all(len(tokens(outputs[f"q{i}"])) == 12 for i in range(5))
    assert len({tuple(tokens(value)) for value in outputs.values()}) == 1  # preemption and recompute change nothing
    assert backend.scheduler.num_preempted > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["one at a time", "launched ahead"])
def test_a_held_request_generates_nothing_until_released_and_then_what_it_would_have(overlap: bool) -> None:
    """Backpressure: a held request gives its pages back and is recomputed when released; a
    step launched ahead drops its token for it, as for a preemption."""
    backend = TorchBackend(engine_options(model_seed=1, overlap_steps=overlap))
    expected = tokens(run_to_end(backend, sampled("h", seed=5, top_k=20))["h"])
    backend.add(sampled("h", seed=5, top_k=20))
    backend.add(sampled("other", max_tokens=40))
    got: list[int] = []
    for _ in range(4):
        got += [token for output in backend._step() if output.request_id == "h" for token in output.new_tokens]
    free = backend.scheduler.blocks.num_free
    assert backend.hold("h") and not backend.hold("h") and not backend.hold("unknown")
    for _ in range(6):
        assert all(output.request_id == "other" for output in backend._step() if output.new_tokens)
    assert backend.scheduler.blocks.num_free > free  # its pages went back
    backend.release("h")
    while backend.has_work():
        got += [token for output in backend._step() if output.request_id == "h" for token in output.new_tokens]
    assert got == expected


def test_abort_frees_the_cache_at_once(backend: TorchBackend) -> None:
    allocator = backend.scheduler.blocks
    free = allocator.num_free
    backend.add(sampled("a", prompt="y" * 100, max_tokens=50))
    backend._step()
    assert allocator.num_free < free
    assert backend.abort("a") and not backend.abort("a")
    assert allocator.num_free == free and not backend.has_work()


async def test_suspend_releases_the_cache_and_requests_survive(backend: TorchBackend) -> None:
    expected = {
        rid: tokens(outs) for rid, outs in run_to_end(backend, sampled("x"), sampled("y", seed=7, top_k=20)).items()
    }
    backend.add(sampled("x"))
    backend.add(sampled("y", seed=7, top_k=20))
    got: dict[str, list[int]] = {"x": [], "y": []}
    for _ in range(5):
        for output in await backend.step():
            got[output.request_id] += output.new_tokens
    await backend.suspend()
    assert backend.runner.kv_cache is None and not backend.has_work()
    assert await backend.step() == []  # a step that slips in while suspended does nothing
    await backend.suspend()  # twice is harmless
    await backend.resume()
    while backend.has_work():
        for output in await backend.step():
            got[output.request_id] += output.new_tokens
    assert got == expected


def test_cpu_profiler_writes_a_trace_whose_path_is_returned(backend: TorchBackend, tmp_path: Path) -> None:
    backend.profiler.trace_dir = tmp_path
    assert str(tmp_path) in backend.start_profiler()
    with pytest.raises(RuntimeError, match="already running"):
        backend.start_profiler()
    run_to_end(backend, sampled("p", max_tokens=2))
    path = Path(backend.stop_profiler())
    assert path.parent == tmp_path and path.stat().st_size > 0
    assert "aten::" in path.read_text()
    with pytest.raises(RuntimeError, match="not running"):
        backend.stop_profiler()


def test_an_empty_kv_cache_is_a_clear_error_at_load() -> None:
    with pytest.raises(KVCacheSizeError, match="comes out empty"):
        TorchBackend(engine_options(kv_cache_gb=1e-9))


def test_dtype_rules() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", ModelConfig(), cpu) == torch.float32
    assert resolve_dtype("auto", ModelConfig(), cuda) == torch.bfloat16
    assert resolve_dtype("auto", ModelConfig(dtype="float16"), cpu) == torch.float16
    assert resolve_dtype("bfloat16", ModelConfig(dtype="float16"), cpu) == torch.bfloat16


def test_checkpoint_dtype_is_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tiny()
    _checkpoint(
        tmp_path, hf_config(config) | {"torch_dtype": "bfloat16", "dtype": None}, random_weights(config, seed=2)
    )
    backend = TorchBackend(engine_options(), str(tmp_path))
    said = [record.getMessage() for record in caplog.records if record.name == "engines.torch_backend.loading"]
    assert said[0].startswith(f"loading weights from {tmp_path}: 1 files, ")  # then progress, then its end
    assert said[-1].startswith(f"loading weights from {tmp_path.name}: done, ")
    assert backend.dtype == torch.bfloat16
    assert next(backend.model.parameters()).dtype == torch.bfloat16
    outputs = run_to_end(backend, GenerationRequest("r", [1, 2, 3], max_tokens=4, temperature=0.0))["r"]
    assert len(tokens(outputs)) == 4


def _checkpoint(path: Path, config: dict[str, object], weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors"))
