"""KV events from engines written from docs/protocol.md alone (benchmarks/doc_engines.py with
benchmarks/doc_prefix_cache.py: no import from this project) against a real coordinator with
``cache_aware`` routing: their prefix hashes are the client library's, their events steer
requests, and a replica that restarts rebuilds its index from their snapshots. If the *KV
events* section of the documentation is wrong, this fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from benchmarks.doc_engines import DocEngineFleet
from benchmarks.doc_prefix_cache import prefixes
from handlers import HANDLERS
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.messages import ChatMessage
from service.protocol.prefix import prefix_hashes, prompt_prefixes
from tests.conftest import make_settings
from tests.helpers import engines_become, until

ENGINE_IDS = ["doc-a", "doc-b", "doc-c"]


@pytest.fixture
def settings(nats_url: str) -> Settings:
    return make_settings(nats_url, routing_policy="cache_aware", cache_aware_prediction_ttl_s=0.001)


@pytest.fixture
async def fleet(coordinator: Coordinator, nc: NATS) -> AsyncIterator[DocEngineFleet]:
    fleet = DocEngineFleet(
        nc,
        coordinator.subjects.prefix,
        ENGINE_IDS,
        heartbeat_interval_s=coordinator.settings.heartbeat_interval_s,
        cached_prompts=4,
    )
    await fleet.start()
    await fleet.register()
    await engines_become(coordinator, 3)
    await until(lambda: len(coordinator.blocks.engines) == 3)  # each snapshotted at its register
    yield fleet
    await fleet.leave()


def test_the_documented_prefix_hashes_are_the_client_librarys() -> None:
    tokens = list(range(1000, 1000 + 16 * 37))
    text = "x" * 64 * 5 + "tail"
    chat = [ChatMessage("system", "s" * 300), ChatMessage("user", "hi")]
    assert prefixes(tokens) == prompt_prefixes(tokens) and len(prefixes(tokens)) == 7
    assert prefixes(text) == prompt_prefixes(text)
    assert prefixes(None, [{"role": m.role, "content": m.content} for m in chat]) == prompt_prefixes(None, chat)
    assert prefixes(list(range(15))) == []


def knows(coordinator: Coordinator, engine_id: str, tokens: list[int]) -> bool:
    found = coordinator.blocks.matches(prefix_hashes(tokens)[-1:], 0.0, 8)
    return engine_id in {engine.engine_id for engine in found}


async def served_by(settings: Settings, prompts: list[list[int]]) -> list[str | None]:
    async with await DpcoordClient.connect(settings) as client:
        finals = await asyncio.gather(*(client.submit(tokens, max_tokens=1) for tokens in prompts))
    return [final.engine_id for final in finals]


async def test_their_events_steer_follow_ups_and_a_restarted_replica_rebuilds_from_their_snapshots(
    settings: Settings, coordinator: Coordinator, fleet: DocEngineFleet
) -> None:
    shared = list(range(1024))
    [home] = await served_by(settings, [shared])
    assert home in ENGINE_IDS
    await until(lambda: knows(coordinator, home, shared))
    assert await served_by(settings, [[*shared, *[seed] * 16] for seed in range(3)]) == [home] * 3
    await coordinator.stop()
    async with Coordinator(settings, HANDLERS) as restarted:
        await until(lambda: knows(restarted, home, shared))
        assert await served_by(settings, [[*shared, *[seed] * 16] for seed in range(3, 6)]) == [home] * 3
        assert restarted.counters["kv_gaps"] == 0  # numbered without a gap, and rebuilt without replay
