"""update_weights with the torch backend over a real NATS server: tiny Llama A serves, then an
update to tiny Llama B; greedy tokens are checked against transformers with the same weights."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from nats.aio.client import Client as NATS

from engines.factory import torch_options
from engines.runtime import EngineRuntime
from engines.torch_backend.backend import TorchBackend
from engines.torch_backend.config import ModelConfig
from engines.torch_backend.families import hf_config
from engines.torch_backend.weight_update import CheckpointMismatch, check_checkpoint
from engines.torch_backend.weights import random_weights
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.messages import Final, Partial
from tests.conftest import make_settings
from tests.torch.reference import TINY, engine_model, hf_greedy, hf_model, tiny

PROMPT = [3, 14, 15, 92, 65]


def save_checkpoint(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config(config)))
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.fixture
def settings(nats_url: str) -> Settings:
    """Round robin, so consecutive requests reach every engine; a heartbeat timeout that a CPU
    busy loading torch models does not trip."""
    return make_settings(nats_url, routing_policy="round_robin", heartbeat_timeout_s=10.0)


@pytest.fixture(scope="module")
def weights_a() -> dict[str, torch.Tensor]:
    return random_weights(TINY, seed=1)


@pytest.fixture(scope="module")
def weights_b() -> dict[str, torch.Tensor]:
    return random_weights(TINY, seed=2)


@pytest.fixture(scope="module")
def greedy() -> Callable[[dict[str, torch.Tensor], list[int], int], list[int]]:
    return lambda weights, prompt, count: hf_greedy(hf_model(TINY, weights), prompt, count)


@pytest.fixture
def dir_a(tmp_path: Path, weights_a: dict[str, torch.Tensor]) -> Path:
    return save_checkpoint(tmp_path / "a", TINY, weights_a)


@pytest.fixture
def dir_b(tmp_path: Path, weights_b: dict[str, torch.Tensor]) -> Path:
    return save_checkpoint(tmp_path / "b", TINY, weights_b)


StartEngines = Callable[[int], Any]


@pytest.fixture
async def torch_engines(settings: Settings, coordinator: Coordinator, dir_a: Path) -> AsyncIterator[StartEngines]:
    """Start torch engines serving tiny Llama A; they are stopped at the end."""
    started: list[EngineRuntime] = []
    engine_settings = settings.model_copy(
        update={"backend": "torch", "device": "cpu", "max_context": 256, "kv_cache_gb": 0.01}
    )

    async def start(count: int) -> list[EngineRuntime]:
        engines = []
        for _ in range(count):
            engine = EngineRuntime(engine_settings, TorchBackend(torch_options(engine_settings), str(dir_a)))
            await engine.start()
            started.append(engine)
            engines.append(engine)
        for engine in engines:
            await asyncio.wait_for(engine.registered.wait(), 30)
        return engines

    yield start
    for engine in started:
        await engine.stop()


@pytest.fixture
async def client(settings: Settings, nc: NATS) -> AsyncIterator[DpcoordClient]:
    async with await DpcoordClient.connect(settings, nc=nc) as connected:
        yield connected


async def greedy_finals(client: DpcoordClient, count: int, max_tokens: int = 8) -> list[Final]:
    """``count`` greedy requests one after the other: round robin sends them to every engine."""
    return [await client.submit(PROMPT, max_tokens=max_tokens, temperature=0.0, timeout=60) for _ in range(count)]


async def test_greedy_tokens_after_an_update_equal_transformers_with_b(
    torch_engines: StartEngines,
    client: DpcoordClient,
    dir_b: Path,
    weights_a: dict[str, torch.Tensor],
    weights_b: dict[str, torch.Tensor],
    greedy: Callable[[dict[str, torch.Tensor], list[int], int], list[int]],
) -> None:
    engines = await torch_engines(2)
    expected_a, expected_b = greedy(weights_a, PROMPT, 8), greedy(weights_b, PROMPT, 8)
    assert expected_a != expected_b
    assert all(final.generated_tokens == expected_a for final in await greedy_finals(client, 4))

    async with client.paused():
        ack = await client.update_weights(str(dir_b), "b")
    assert ack.weight_version == "b" and set(ack.engines or {}) == {engine.engine_id for engine in engines}
    late = (await torch_engines(1))[0]  # registers after the update: loads B before it serves
    assert late.weights.version == "b" and late.weights.digest == ack.digest

    finals = await greedy_finals(client, 9)
    assert {final.engine_id for final in finals} == {engine.engine_id for engine in [*engines, late]}
    assert all(final.generated_tokens == expected_b for final in finals)
    assert all(final.weight_versions is not None and final.weight_versions[0].version == "b" for final in finals)


async def test_a_mismatched_checkpoint_is_refused_and_every_engine_still_serves_a(
    torch_engines: StartEngines,
    client: DpcoordClient,
    tmp_path: Path,
    weights_a: dict[str, torch.Tensor],
    weights_b: dict[str, torch.Tensor],
    greedy: Callable[[dict[str, torch.Tensor], list[int], int], list[int]],
) -> None:
    engines = await torch_engines(2)
    narrower = tiny(intermediate_size=128)
    wrong_shape = save_checkpoint(tmp_path / "shape", narrower, random_weights(narrower, seed=3))
    wrong_dtype = save_checkpoint(
        tmp_path / "dtype", TINY, {name: tensor.to(torch.bfloat16) for name, tensor in weights_b.items()}
    )
    await client.pause()
    with pytest.raises(ClientError) as shape:
        await client.update_weights(str(wrong_shape), "c")
    assert shape.value.code == 400 and "mlp" in shape.value.message and "has shape" in shape.value.message
    with pytest.raises(ClientError) as dtype:
        await client.update_weights(str(wrong_dtype), "d")
    assert dtype.value.code == 400 and "has dtype BF16, the running model's is float32" in dtype.value.message
    assert all(name in dtype.value.message for name in ("refused by engines", "keeps its weights"))
    await client.unpause()
    assert all(engine.weights.version is None for engine in engines)
    finals = await greedy_finals(client, 4)
    assert {final.engine_id for final in finals} == {engine.engine_id for engine in engines}
    assert all(final.generated_tokens == greedy(weights_a, PROMPT, 8) for final in finals)


async def test_a_keep_request_spanning_the_update_reports_two_spans_and_continues_with_b(
    torch_engines: StartEngines,
    client: DpcoordClient,
    dir_b: Path,
    weights_a: dict[str, torch.Tensor],
    weights_b: dict[str, torch.Tensor],
    greedy: Callable[[dict[str, torch.Tensor], list[int], int], list[int]],
) -> None:
    await torch_engines(1)
    total = 240
    stream = client.stream(PROMPT, max_tokens=total, temperature=0.0, timeout=60)
    assert isinstance(await anext(stream), Partial)
    async with client.paused(mode="keep"):
        await client.update_weights(str(dir_b), 2)
    final = [reply async for reply in stream][-1]
    assert isinstance(final, Final) and len(final.generated_tokens) == total
    assert final.weight_versions is not None and [span.version for span in final.weight_versions] == [None, 2]
    split = final.weight_versions[0].end
    before, after = final.generated_tokens[:split], final.generated_tokens[split:]
    assert 0 < split < total and final.weight_versions[1].start == split
    assert before == greedy(weights_a, PROMPT, split)
    # The swap recomputes the request's KV cache with B: it goes on as B would from there.
    assert after == greedy(weights_b, PROMPT + before, total - split)


def test_the_check_names_the_first_tensor_that_does_not_fit(tmp_path: Path, weights_a: dict[str, torch.Tensor]) -> None:
    model = engine_model(TINY, weights_a)
    assert len(check_checkpoint(model, torch.float32, save_checkpoint(tmp_path / "ok", TINY, weights_a))) == 1
    extra = dict(weights_a, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    missing = {name: tensor for name, tensor in weights_a.items() if name != "model.norm.weight"}
    cases = {
        "extra": (
            extra,
            "model.layers.9.mlp.up_proj.weight (in model.safetensors) is not a tensor of the running model",
        ),
        "missing": (missing, "model.norm.weight is missing from the checkpoint (1 tensors missing)"),
    }
    for name, (weights, message) in cases.items():
        with pytest.raises(CheckpointMismatch) as refused:
            check_checkpoint(model, torch.float32, save_checkpoint(tmp_path / name, TINY, weights))
        assert refused.value.code == 400 and refused.value.message == message
    with pytest.raises(CheckpointMismatch, match="has dtype F32, the running model's is bfloat16"):
        check_checkpoint(model, torch.bfloat16, tmp_path / "ok")


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_backend_swaps_in_place_mid_request(
    device: str,
    overlap: bool,
    dir_a: Path,
    dir_b: Path,
    weights_a: dict[str, torch.Tensor],
    weights_b: dict[str, torch.Tensor],
    greedy: Callable[[dict[str, torch.Tensor], list[int], int], list[int]],
) -> None:
    """A request 5 steps in when the weights change (with a step launched ahead when steps
    overlap) goes on as B continues its tokens; the parameters' storage, and so any CUDA
    graph captured on it, stays."""
    from engines.backend import GenerationRequest
    from tests.torch.reference import engine_options

    options = engine_options(device=device, dtype="float32", overlap_steps=overlap)
    backend = TorchBackend(options, str(dir_a))
    storage = [parameter.data_ptr() for parameter in backend.model.parameters()]
    graphs = backend.graphs
    backend.add(GenerationRequest("r", PROMPT, max_tokens=20, temperature=0.0))
    generated: list[int] = []
    while len(generated) < 5:
        generated += [token for output in backend._step() for token in output.new_tokens]
    asyncio.run(backend.swap_weights(backend.stage_weights(dir_b)))
    assert [parameter.data_ptr() for parameter in backend.model.parameters()] == storage
    assert backend.graphs is graphs
    while backend.has_work():
        generated += [token for output in backend._step() for token in output.new_tokens]
    split = 5
    assert generated[:split] == greedy(weights_a, PROMPT, split)
    assert generated[split:] == greedy(weights_b, PROMPT + generated[:split], 20 - split)
