"""cache_aware routing by the torch backend's real KV events, on a real nats-server: two torch
engines on CPU with prefix caching, a coordinator whose predictions expire at once, so only
the engines' events can send a follow-up to the engine whose cache holds its prompt's prefix."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from engines.factory import torch_options
from engines.runtime import EngineRuntime
from engines.torch_backend.backend import TorchBackend
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.prefix import prefix_hashes
from tests.conftest import make_settings
from tests.helpers import until


@pytest.fixture
def settings(nats_url: str) -> Settings:
    return make_settings(nats_url, routing_policy="cache_aware", cache_aware_prediction_ttl_s=0.001)


@pytest.fixture
async def torch_engines(settings: Settings, coordinator: Coordinator) -> AsyncIterator[list[EngineRuntime]]:
    engine_settings = settings.model_copy(
        update={"backend": "torch", "device": "cpu", "max_context": 256, "kv_cache_gb": 0.01}
    )
    engines = []
    for n in range(2):
        options = dataclasses.replace(torch_options(engine_settings), max_batch=8)
        engine = EngineRuntime(engine_settings.model_copy(update={"engine_id": f"torch{n}"}), TorchBackend(options))
        await engine.start()
        engines.append(engine)
    for engine in engines:
        await asyncio.wait_for(engine.registered.wait(), 30)
    await until(lambda: len(coordinator.blocks.engines) == 2)  # both snapshotted: they publish KV events
    yield engines
    for engine in engines:
        await engine.stop()


def holder(coordinator: Coordinator, tokens: list[int]) -> set[str]:
    """The engines the coordinator's block index has holding ``tokens``' longest prefix."""
    return {engine.engine_id for engine in coordinator.blocks.matches(prefix_hashes(tokens)[-1:], 0.0, 8)}


async def test_follow_ups_go_to_the_engine_whose_kv_events_hold_their_prefix(
    settings: Settings, coordinator: Coordinator, torch_engines: list[EngineRuntime]
) -> None:
    first, second = [list(range(start, start + 96)) for start in (0, 100)]  # six pages each
    async with await DpcoordClient.connect(settings) as client:
        finals = await asyncio.gather(*(client.submit(prompt, max_tokens=1) for prompt in (first, second)))
        homes = [final.engine_id for final in finals]
        assert len(set(homes)) == 2  # the second saw the first's load at once
        await until(lambda: holder(coordinator, first) == {homes[0]} and holder(coordinator, second) == {homes[1]})
        follow_ups = [[*prompt, 7, turn] for turn in range(3) for prompt in (first, second)]
        served = [(await client.submit(prompt, max_tokens=1)).engine_id for prompt in follow_ups]
    assert served == homes * 3
    for engine in torch_engines:
        stats = engine.backend.prefix_cache_stats()
        assert stats is not None and stats.hit_tokens == 3 * 96  # each follow-up read its six pages
    assert coordinator.counters["kv_gaps"] == 0
