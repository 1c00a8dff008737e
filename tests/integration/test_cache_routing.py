"""cache_aware routing on a real nats-server: KV events steer requests, a gap is answered by a
snapshot, a replica that restarts rebuilds its index from the engines' snapshots; sessions and
groups stay on one engine (echo engines, the client library and the HTTP gateway).

The engines are echo engines, whose simulated prefix cache publishes KV events as the engine
runtime does for any backend (tests/torch/test_torch_cache_routing.py has the torch backend's),
and :class:`tests.kv_engine_double.KvEngineDouble`, a test double of the wire that holds what a
test tells it and can lose events on the way. Routing's predictions expire at once here, so
only the engines' events steer.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import msgspec
import openai
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from openai.types.chat import ChatCompletionMessageParam

from handlers import HANDLERS
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.coordinator.metrics import CoordinatorCollector
from service.ops.settings import Settings
from service.protocol.messages import SubmitEnvelope
from service.protocol.prefix import TOKENS_PER_BLOCK, prefix_hashes
from tests.conftest import EngineFactory, make_settings
from tests.helpers import engines_become, until
from tests.kv_engine_double import KvEngineDouble


@pytest.fixture
def settings(nats_url: str) -> Settings:
    return make_settings(nats_url, routing_policy="cache_aware", cache_aware_prediction_ttl_s=0.001)


@pytest.fixture
async def doubles(nc: NATS, settings: Settings, coordinator: Coordinator) -> AsyncIterator[list[KvEngineDouble]]:
    """Three engines with a prefix cache (test doubles), registered and snapshotted."""
    fleet = [KvEngineDouble(nc, settings.subject_prefix, f"kv{n}") for n in range(3)]
    for double in fleet:
        await double.start()
    await engines_become(coordinator, 3)
    await until(lambda: all(double.snapshots == 1 for double in fleet))
    yield fleet
    for double in fleet:
        await double.stop()


def prompt(shared: int, own: int = 1, seed: int = 0) -> list[int]:
    return list(range(shared * TOKENS_PER_BLOCK)) + [40_000 + seed] * (own * TOKENS_PER_BLOCK)


def knows(coordinator: Coordinator, engine_id: str, tokens: list[int]) -> bool:
    """``coordinator``'s block index has ``engine_id`` holding ``tokens``' longest prefix."""
    hashes = prefix_hashes(tokens)
    found = coordinator.blocks.matches(hashes[-1:], 0.0, 8)
    return engine_id in {engine.engine_id for engine in found}


async def served_by(settings: Settings, prompts: list[list[int]]) -> list[str | None]:
    async with await DpcoordClient.connect(settings) as client:
        finals = await asyncio.gather(*(client.submit(tokens, max_tokens=1) for tokens in prompts))
    return [final.engine_id for final in finals]


async def test_requests_go_where_the_kv_events_say_the_prefix_is(
    settings: Settings, coordinator: Coordinator, doubles: list[KvEngineDouble]
) -> None:
    shared = prompt(64, own=0)
    await doubles[1].hold(shared)
    await until(lambda: knows(coordinator, "kv1", shared))
    assert await served_by(settings, [prompt(64, 1, seed) for seed in range(4)]) == ["kv1"] * 4


async def test_the_coordinators_metrics_give_the_block_index_size(
    coordinator: Coordinator, doubles: list[KvEngineDouble]
) -> None:
    def gauges() -> dict[str, float]:
        return {
            family.name: family.samples[0].value
            for family in CoordinatorCollector(coordinator).collect()
            if family.name.startswith("dpcoord_kv_index_")
        }

    assert gauges() == dict.fromkeys(
        ("dpcoord_kv_index_entries", "dpcoord_kv_index_prefixes", "dpcoord_kv_index_predictions"), 0
    ) | {"dpcoord_kv_index_engines": 3}
    shared = prompt(64, own=0)
    await doubles[0].hold(shared)
    await doubles[1].hold(shared)
    await until(lambda: knows(coordinator, "kv0", shared) and knows(coordinator, "kv1", shared))
    held = len(prefix_hashes(shared))
    assert gauges() == {
        "dpcoord_kv_index_engines": 3,
        "dpcoord_kv_index_entries": 2 * held,
        "dpcoord_kv_index_prefixes": held,
        "dpcoord_kv_index_predictions": 0,
    }


async def test_a_gap_in_the_numbering_is_answered_by_a_snapshot(
    settings: Settings, coordinator: Coordinator, doubles: list[KvEngineDouble]
) -> None:
    shared = prompt(64, own=0, seed=5)
    await doubles[2].hold(shared, lost=1)  # event 1 never arrived: the coordinator asks what it holds
    await until(lambda: doubles[2].snapshots == 2 and knows(coordinator, "kv2", shared))
    assert coordinator.counters["kv_gaps"] == 1
    assert await served_by(settings, [prompt(64, 1, seed) for seed in range(3)]) == ["kv2"] * 3


async def test_a_replica_that_restarts_rebuilds_its_index_from_the_engines(
    settings: Settings, coordinator: Coordinator, doubles: list[KvEngineDouble]
) -> None:
    shared = prompt(64, own=0, seed=7)
    await doubles[0].hold(shared)
    await until(lambda: knows(coordinator, "kv0", shared))
    await coordinator.stop()
    async with Coordinator(settings, HANDLERS) as restarted:  # nothing replayed: the heartbeats introduce the fleet
        await until(lambda: all(double.snapshots == 2 for double in doubles))
        await until(lambda: knows(restarted, "kv0", shared))
        assert await served_by(settings, [prompt(64, 1, seed) for seed in range(3)]) == ["kv0"] * 3


async def test_echo_engines_events_steer_follow_ups_also_after_a_replica_restarts(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(3)
    await until(lambda: len(coordinator.blocks.engines) == 3)
    shared = prompt(64, own=0, seed=3)
    [home] = await served_by(settings, [shared])
    assert home is not None
    await until(lambda: knows(coordinator, home, shared))
    assert await served_by(settings, [prompt(64, 1, seed) for seed in range(3)]) == [home] * 3
    await coordinator.stop()
    async with Coordinator(settings, HANDLERS) as restarted:
        await until(lambda: knows(restarted, home, shared))  # from the snapshots the heartbeats prompted
        assert await served_by(settings, [prompt(64, 1, seed) for seed in range(3, 6)]) == [home] * 3


async def test_a_session_stays_on_its_engine_and_moves_when_it_leaves(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    engines = await start_engines(3)
    async with await DpcoordClient.connect(settings) as client:
        homes = {(await client.submit("hello", max_tokens=2, session_id="s1")).engine_id for _ in range(4)}
        assert len(homes) == 1
        [home] = homes
        await next(engine for engine in engines if engine.engine_id == home).stop()
        await engines_become(coordinator, 2)
        moved = {(await client.submit("hello", max_tokens=2, session_id="s1")).engine_id for _ in range(3)}
        assert len(moved) == 1 and home not in moved


async def test_a_group_runs_on_one_engine_however_its_submissions_arrive(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(3)
    async with await DpcoordClient.connect(settings) as client:
        together = await asyncio.gather(
            *(client.submit("the same prompt", max_tokens=2, group_id="g1", seed=n) for n in range(4))
        )
        one_by_one = [await client.submit("another prompt", max_tokens=2, group_id="g2", seed=n) for n in range(4)]
    assert len({final.engine_id for final in together}) == 1
    assert len({final.engine_id for final in one_by_one}) == 1  # least_loaded would take turns


@pytest.fixture
async def wire(nc: NATS, settings: Settings) -> AsyncIterator[tuple[Counter[str], list[SubmitEnvelope]]]:
    """What the gateway submits and where the coordinator routes it, read off the wire: the
    client library's envelopes on ``<prefix>.submit_request`` or a replica's own
    ``<prefix>.submit_request.<coordinator_id>``, and the requests routed per engine on
    ``<prefix>.engine.<engine_id>.submit_request``."""
    routed: Counter[str] = Counter()
    submitted: list[SubmitEnvelope] = []

    async def route(msg: Msg) -> None:
        routed[msg.subject.split(".")[-2]] += len(msgspec.msgpack.decode(msg.data)[0])

    async def submit(msg: Msg) -> None:
        submitted.append(msgspec.msgpack.decode(msg.data, type=SubmitEnvelope))

    subscriptions = [
        await nc.subscribe(f"{settings.subject_prefix}.engine.*.submit_request", cb=route),
        await nc.subscribe(f"{settings.subject_prefix}.submit_request", cb=submit),
        await nc.subscribe(f"{settings.subject_prefix}.submit_request.*", cb=submit),
    ]
    await nc.flush()
    yield routed, submitted
    for subscription in subscriptions:
        await subscription.unsubscribe()


async def test_the_gateway_keeps_a_session_and_groups_the_choices_of_a_prompt(
    aclient: openai.AsyncOpenAI, start_engines: EngineFactory, wire: tuple[Counter[str], list[SubmitEnvelope]]
) -> None:
    routed, submitted = wire
    await start_engines(3)
    chat = aclient.chat.completions
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    for _ in range(3):
        await chat.create(model="dpcoord-echo", messages=messages, max_tokens=2, extra_headers={"X-Session-ID": "c1"})
    await until(lambda: sum(routed.values()) == 3)
    assert len(routed) == 1 and {envelope.session_id for envelope in submitted} == {"c1"}
    routed.clear()
    submitted.clear()
    answer = await chat.create(model="dpcoord-echo", messages=messages, max_tokens=2, n=4)
    assert len(answer.choices) == 4
    await until(lambda: sum(routed.values()) == 4 and len(submitted) == 4)
    [group] = {envelope.group_id for envelope in submitted}
    assert group is not None and len(routed) == 1
    with pytest.raises(openai.BadRequestError, match="X-Session-ID"):
        await chat.create(
            model="dpcoord-echo", messages=messages, max_tokens=2, extra_headers={"X-Session-ID": "x" * 257}
        )
