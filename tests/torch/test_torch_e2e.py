"""The torch backend behind the coordinator, over a real NATS server: streaming, refusals
forwarded to the client, control signals and the profiler ack."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from engines.factory import torch_options
from engines.observability import engine_observability
from engines.runtime import EngineRuntime
from engines.torch_backend.backend import TorchBackend
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.http_endpoints import METRICS_PATH
from service.ops.settings import Settings
from service.protocol.messages import Final, Partial
from service.protocol.subjects import Header
from tests.helpers import request_json
from tests.integration.test_observability import http_get, port_of, samples, value


@pytest.fixture(params=[False, True], ids=["one at a time", "launched ahead"])
async def torch_engine(
    settings: Settings, coordinator: Coordinator, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[EngineRuntime]:
    """Also with steps launched ahead, as on CUDA: the runtime then publishes each step's replies
    as soon as the step returns (``Backend.launches_ahead``)."""
    engine_settings = settings.model_copy(
        update={
            "backend": "torch",
            "device": "cpu",
            "max_context": 128,
            "kv_cache_gb": 0.005,
            "profile_dir": str(tmp_path),
        }
    )
    options = dataclasses.replace(torch_options(engine_settings), overlap_steps=request.param)
    engine = EngineRuntime(engine_settings, TorchBackend(options))
    await engine.start()
    await coordinator.wait_for_engines(1)
    await engine.registered.wait()
    yield engine
    await engine.stop()


@pytest.fixture
async def client(settings: Settings, nc: NATS) -> AsyncIterator[DpcoordClient]:
    async with await DpcoordClient.connect(settings, nc=nc) as connected:
        yield connected


async def test_stream_a_request_through_the_coordinator(torch_engine: EngineRuntime, client: DpcoordClient) -> None:
    replies = [reply async for reply in client.stream("Hello", max_tokens=12, seed=5, timeout=30)]
    *rest, final = replies
    partials = [reply for reply in rest if isinstance(reply, Partial)]
    assert len(partials) == len(rest) and isinstance(final, Final)
    assert len(partials) >= 2  # stream_interval 1: text arrives token by token
    assert final.engine_id == torch_engine.engine_id and final.finish_reason == "length"
    assert [token for partial in partials for token in partial.new_tokens] == final.generated_tokens
    assert len(final.generated_tokens) == 12
    assert "".join(partial.text for partial in partials) == final.generated_text
    again = await client.submit("Hello", max_tokens=12, seed=5, timeout=30)
    assert again.generated_tokens == final.generated_tokens


async def test_a_json_request_like_the_nats_cli_with_defaults(
    torch_engine: EngineRuntime, coordinator: Coordinator, nc: NATS
) -> None:
    reply = await request_json(
        nc, coordinator.subjects.coordinator(Header.SUBMIT_REQUEST), {"prompt": [72, 105]}, timeout=30
    )
    assert reply["type"] == "final" and len(reply["generated_tokens"]) == 16 and reply["finish_reason"] == "length"


async def test_refusals_reach_the_client(torch_engine: EngineRuntime, client: DpcoordClient) -> None:
    with pytest.raises(ClientError) as outside:
        await client.submit([1, 99999], timeout=30)
    assert outside.value.code == 400 and "vocabulary" in outside.value.message
    with pytest.raises(ClientError) as too_long:
        await client.submit("x" * 500, timeout=30)
    assert too_long.value.code == 413 and "context of 128" in too_long.value.message
    served = await client.submit("still serving", max_tokens=2, timeout=30)
    assert len(served.generated_tokens) == 2


async def test_suspend_and_resume_keep_requests_in_flight(torch_engine: EngineRuntime, client: DpcoordClient) -> None:
    expected = await client.submit("Survive", max_tokens=100, seed=9, timeout=30)
    stream = client.stream("Survive", max_tokens=100, seed=9, timeout=60)
    received = [await anext(stream)]
    await client.pause()
    await client.suspend()  # allowed from paused, as in Megatron
    assert torch_engine.backend.runner.kv_cache is None  # type: ignore[attr-defined]
    assert torch_engine.load == 1  # still in flight
    await client.resume()  # back to paused
    await client.unpause()
    received += [reply async for reply in stream]
    final = received[-1]
    assert isinstance(final, Final) and final.generated_tokens == expected.generated_tokens


async def test_profiler_ack_carries_the_trace_path(
    torch_engine: EngineRuntime, client: DpcoordClient, tmp_path: Path
) -> None:
    await client.start_profiler()
    await client.submit("profile me", max_tokens=3, timeout=30)
    ack = await client.stop_profiler()
    assert ack.engines is not None
    trace = Path(ack.engines[torch_engine.engine_id])
    assert trace.parent == tmp_path and trace.stat().st_size > 0


async def test_prefix_cache_hits_show_in_metrics_and_status(
    torch_engine: EngineRuntime, client: DpcoordClient, nc: NATS
) -> None:
    system = "You are a terse assistant; answer in one word. "  # 47 byte tokens: two full 16-token pages
    assert len(system) == 47
    await client.submit(system + "Sky?", max_tokens=2, timeout=30)
    await client.submit(system + "Air?", max_tokens=2, timeout=30)  # the third page differs at token 47
    observability = engine_observability(torch_engine, "127.0.0.1", 0)
    await observability.start(torch_engine.nc)
    try:
        scrape = samples((await http_get(port_of(observability), METRICS_PATH))[1])
        status = await request_json(nc, torch_engine.subjects.status("engine", torch_engine.engine_id), {})
    finally:
        await observability.stop()
    assert value(scrape, "dpcoord_engine_prefix_cache_hit_tokens_total") == 32
    assert value(scrape, "dpcoord_engine_prefix_cache_queried_tokens_total") == 2 * 51
    assert value(scrape, "dpcoord_engine_prefix_cache_hit_rate") == pytest.approx(32 / 102)
    assert value(scrape, "dpcoord_engine_prefix_cache_pages") >= 2
    assert value(scrape, "dpcoord_engine_kv_cache_pages") > 2
    cache = status["prefix_cache"]
    assert (cache["hit_tokens"], cache["queried_tokens"]) == (32, 102) and cache["cached_pages"] >= 2
