"""The client library against a live coordinator and echo engines."""

from __future__ import annotations

import asyncio

import pytest

from handlers import HANDLERS
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.messages import Final, Partial
from tests.conftest import EngineFactory


async def test_submit_stream_abort_and_control(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(2, token_delay_ms=10)
    async with await DpcoordClient.connect(settings, client_id="tester") as client:
        assert client.client_id == "tester" and client.coordinator_id == coordinator.id
        final = await client.submit("abc", max_tokens=4, client_request_id="a")
        assert (final.generated_text, final.finish_reason, final.client_request_id) == ("abca", "length", "a")

        replies = [reply async for reply in client.stream("xyz", max_tokens=3)]
        assert [type(reply) for reply in replies] == [Partial, Partial, Partial, Final]

        stream = client.stream("long", max_tokens=100_000, client_request_id="b")
        first = await anext(stream)
        assert isinstance(first, Partial)
        ack = await client.abort("b")
        assert ack.request_id == first.request_id
        rest = [reply async for reply in stream]
        assert isinstance(rest[-1], Final) and rest[-1].finish_reason == "abort"

        assert (await client.pause()).state == "paused"
        assert (await client.suspend()).state == "suspended"
        assert (await client.resume()).state == "paused"
        assert (await client.set_generation_epoch(4)).epoch == 4
        assert (await client.unpause()).state == "running"
        assert (await client.start_profiler()).engines is not None
        assert (await client.stop_profiler()).signal == "stop_cuda_profiler"


async def test_errors_raise_client_error_with_the_code(settings: Settings, coordinator: Coordinator) -> None:
    async with await DpcoordClient.connect(settings) as client:
        with pytest.raises(ClientError) as no_engine:
            await client.submit("x")
        assert no_engine.value.code == 503
        with pytest.raises(ClientError) as conflict:
            await client.unpause()
        assert conflict.value.code == 409
        with pytest.raises(ClientError) as unknown:
            await client.abort("never-sent")
        assert unknown.value.code == 404


async def test_calls_time_out(settings: Settings, coordinator: Coordinator, start_engines: EngineFactory) -> None:
    await start_engines(1, token_delay_ms=200)
    async with await DpcoordClient.connect(settings) as client:
        # The timeout is also the request's deadline at the coordinator: whichever fires first.
        with pytest.raises((TimeoutError, ClientError)) as waited:
            await client.submit("slow", max_tokens=50, timeout=0.3)
        assert not isinstance(waited.value, ClientError) or waited.value.code == 504
        with pytest.raises((TimeoutError, ClientError)) as streamed:
            async for _ in client.stream("slow", max_tokens=50, timeout=0.3):
                pass
        assert not isinstance(streamed.value, ClientError) or streamed.value.code == 504


async def test_connect_without_coordinator_is_a_clear_error(settings: Settings) -> None:
    with pytest.raises(ClientError) as caught:
        await DpcoordClient.connect(settings, timeout=2)
    assert caught.value.code == 503 and "no coordinator" in caught.value.message


async def test_shutdown_stops_the_coordinator(settings: Settings) -> None:
    coordinator = Coordinator(settings, HANDLERS)
    await coordinator.start()
    async with await DpcoordClient.connect(settings) as client:
        assert (await client.shutdown()).signal == "shutdown"
    await asyncio.wait_for(coordinator.run_until_stopped(), 5)
    await coordinator.stop()
