"""Model names: engines report theirs, the coordinator routes a submission that names a model
only to engines serving it (404 for a model nobody serves), holds requests per model, and lists
the fleet's models; through the gateway, two models are routed apart and 200 concurrent streams
each end with exactly one ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import openai
import pytest
from nats.aio.client import Client as NATS

from engines.backend import GenerationRequest
from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.messages import ChatMessage
from tests.conftest import EngineFactory, make_settings
from tests.gateway_helpers import http, serve_gateway, sse_data, wait_until
from tests.helpers import request_json


class RecordingEcho(EchoBackend):
    """Echo that keeps every prompt it was given."""

    def __init__(self, token_delay_ms: float = 0.0) -> None:
        super().__init__(token_delay_ms)
        self.prompts: list[str | list[int]] = []

    def add(self, request: GenerationRequest) -> int:
        self.prompts.append(request.prompt)
        return super().add(request)


@pytest.fixture
async def two_models(settings: Settings, coordinator: Coordinator) -> AsyncIterator[dict[str, RecordingEcho]]:
    backends = {"alpha": RecordingEcho(), "beta": RecordingEcho()}
    engines = [
        EngineRuntime(settings.model_copy(update={"served_model_name": name}), backend)
        for name, backend in backends.items()
    ]
    for engine in engines:
        await engine.start()
    await coordinator.wait_for_engines(2)
    yield backends
    for engine in engines:
        await engine.stop()


async def test_two_models_are_routed_apart_through_the_gateway(
    settings: Settings, two_models: dict[str, RecordingEcho]
) -> None:
    async with serve_gateway(settings) as served:
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        assert sorted(model.id for model in (await client.models.list()).data) == ["alpha", "beta"]
        completions = await asyncio.gather(
            *(
                client.completions.create(model=model, prompt=f"{model}-{i}", max_tokens=1)
                for i in range(10)
                for model in ("alpha", "beta")
            )
        )
        assert all(completion.model in ("alpha", "beta") for completion in completions)
        await client.close()
    for model, backend in two_models.items():
        assert len(backend.prompts) == 10
        assert all(str(prompt).startswith(f"{model}-") for prompt in backend.prompts)


async def test_the_coordinator_lists_models_and_refuses_unknown_ones(
    settings: Settings, coordinator: Coordinator, two_models: dict[str, RecordingEcho], nc: NATS
) -> None:
    async with await DpcoordClient.connect(settings, nc=nc) as client:
        listing = await client.list_models()
        assert [(m.name, m.engines, m.capacity, m.in_flight) for m in listing.models] == [
            ("alpha", 1, 256, 0),
            ("beta", 1, 256, 0),
        ]
        final = await client.submit(messages=[ChatMessage("user", "Hi")], model="beta", max_tokens=4)
        assert final.generated_text == "user" and final.prompt_tokens == len(b"user: Hi\nassistant:")
        assert two_models["beta"].prompts == ["user: Hi\nassistant:"] and two_models["alpha"].prompts == []
        await wait_until(lambda: coordinator.peers.warmed_up)
        with pytest.raises(ClientError) as unknown:
            await client.submit("Hi", model="gamma")
        assert unknown.value.code == 404 and "served: alpha, beta" in unknown.value.message
    subject = coordinator.subjects.coordinator("submit_request")
    reply = await request_json(
        nc,
        subject,
        {"messages": [{"role": "user", "content": "Yo"}], "model": "alpha", "sampling_params": {"max_tokens": 3}},
    )
    assert (reply["type"], reply["generated_text"], reply["prompt_tokens"]) == ("final", "use", 19)
    models = await request_json(nc, coordinator.subjects.coordinator("list_models"), {})
    assert models == {
        "type": "models",
        "models": [
            {"name": "alpha", "engines": 1, "capacity": 256, "in_flight": 0},
            {"name": "beta", "engines": 1, "capacity": 256, "in_flight": 0},
        ],
    }


async def test_a_new_replica_learns_model_names_from_heartbeats(
    settings: Settings, coordinator: Coordinator, two_models: dict[str, RecordingEcho]
) -> None:
    async with Coordinator(settings, HANDLERS) as replica:
        await replica.wait_for_engines(2)
        assert replica.engines.models() == ["alpha", "beta"]


async def test_a_full_model_does_not_hold_back_another(nats_url: str) -> None:
    """While paused, three requests for a busy model and one for another are held; after unpause
    the other model's request runs at once instead of queueing behind the busy model's."""
    settings = make_settings(nats_url, max_inflight_per_engine=1)
    async with Coordinator(settings, HANDLERS) as coordinator:
        slow = EngineRuntime(settings.model_copy(update={"served_model_name": "slow"}), EchoBackend(token_delay_ms=30))
        fast = EngineRuntime(settings.model_copy(update={"served_model_name": "fast"}), EchoBackend())
        async with slow, fast, await DpcoordClient.connect(settings) as client:
            await coordinator.wait_for_engines(2)
            await client.pause()
            finished: list[str] = []

            async def run(model: str, name: str) -> None:
                await client.submit(name, model=model, max_tokens=20)
                finished.append(name)

            held = [asyncio.ensure_future(run("slow", f"slow{i}")) for i in range(3)]
            await wait_until(lambda: len(coordinator.requests) == 3)
            other = asyncio.ensure_future(run("fast", "fast"))
            await wait_until(lambda: len(coordinator.requests) == 4)
            await client.unpause()
            await asyncio.gather(*held, other)
            assert finished.index("fast") < finished.index("slow1")


async def test_200_concurrent_streams_each_end_with_one_done(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(2)
    async with serve_gateway(settings) as served:
        bodies = [
            {"model": "dpcoord-echo", "prompt": f"s{i}", "max_tokens": 8, "stream": True}
            if i % 2
            else {
                "model": "dpcoord-echo",
                "messages": [{"role": "user", "content": f"s{i}"}],
                "max_tokens": 8,
                "stream": True,
            }
            for i in range(200)
        ]
        responses = await asyncio.gather(
            *(
                http(served.port, "POST", "/v1/completions" if "prompt" in body else "/v1/chat/completions", body)
                for body in bodies
            )
        )
    for response in responses:
        events = sse_data(response.body)
        assert response.status == 200 and events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
