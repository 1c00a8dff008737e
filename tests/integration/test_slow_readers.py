"""Slow readers on real nats-server (docs/reliability.md, *Slow readers*): a stream whose reader
stops is held in its engine (the tokens generated for it stop growing), released when read and
exact, and aborted after the stall limit, its reader told with 408; through the client
library and through the gateway, beside streams read normally. An engine of an earlier release
(benchmarks/doc_engines.py, written from the protocol page and knowing no holds) ends its stalled
stream with the same 408 at twice the bound. Bounds and limits are small, so each test takes
about a second."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS

from benchmarks.doc_engines import DocEngineFleet
from service.client import DpcoordClient, FlowLimits, StreamStalled
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.messages import Final, Partial
from tests.conftest import EngineFactory, make_settings
from tests.gateway_helpers import wait_until

BUFFER_BYTES = 8192  # some 45 one-token partials
MAX_TOKENS = 1000
TOKEN_DELAY_MS = 1.0  # a hold reaches the engine within a few of its tokens


@pytest.fixture
def settings(nats_url: str) -> Settings:
    """A heartbeat timeout long enough that a loaded machine does not lose the one engine
    these streams run on (the test process runs all of it)."""
    return make_settings(nats_url, heartbeat_timeout_s=5.0)


def echo(prompt: str, max_tokens: int) -> str:
    """What the echo engine generates for an ASCII prompt (engines/echo.py)."""
    return "".join(prompt[n % len(prompt)] for n in range(max_tokens))


async def test_a_stalled_stream_beside_an_engine_that_predates_holds_ends_with_408_at_twice_its_bound(
    coordinator: Coordinator, nc: NATS
) -> None:
    fleet = DocEngineFleet(
        nc, coordinator.subjects.prefix, ["old"], capacity=8, heartbeat_interval_s=0.2, token_delay_s=0.001
    )
    await fleet.start()
    await fleet.register()
    engine = fleet.engines["old"]
    async with await DpcoordClient.connect(coordinator.settings) as client:
        stream = client.stream("abc", max_tokens=1_000_000, flow=FlowLimits(BUFFER_BYTES, 60), timeout=60)
        await anext(stream)  # the reader stops here
        await wait_until(lambda: bool(engine.active))
        await wait_until(lambda: not engine.active)  # the client aborted it: the engine freed it
        with pytest.raises(StreamStalled, match="did not hold it") as raised:
            async for _ in stream:
                pass
        assert raised.value.code == 408
        final = await client.submit("abc", max_tokens=5, timeout=10)  # the client goes on
        assert final.generated_text == "abcab"
    await fleet.leave()


async def test_a_library_stream_whose_reader_stops_is_held_beside_a_normal_one_and_exact_when_read(
    coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    [engine] = await start_engines(1, token_delay_ms=TOKEN_DELAY_MS)
    async with await DpcoordClient.connect(coordinator.settings) as client:
        stream = client.stream("abc", max_tokens=MAX_TOKENS, flow=FlowLimits(BUFFER_BYTES, 60), timeout=60)
        replies: list[Partial | Final] = [await anext(stream)]  # the reader stops here
        request_id = replies[0].request_id
        await wait_until(lambda: engine.requests.held_back() == [request_id])
        held_at = len(engine.requests.records[request_id].tokens)
        assert held_at < MAX_TOKENS // 4  # held some 45 tokens in, long before its end
        beside = await client.submit("xyz", max_tokens=200, timeout=30)  # 200 steps of the engine meanwhile
        assert beside.generated_text == echo("xyz", 200)
        assert len(engine.requests.records[request_id].tokens) == held_at  # not a token more while held
        replies += [reply async for reply in stream]  # read again: released, to its end
        assert engine.counters["releases"] >= 1 and not engine.requests.held_back()
    final = replies[-1]
    assert isinstance(final, Final) and final.generated_text == echo("abc", MAX_TOKENS)
    assert "".join(reply.text for reply in replies if isinstance(reply, Partial)) == final.generated_text


async def test_a_library_stream_held_past_the_stall_limit_is_aborted_and_raises_408_when_read(
    coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    [engine] = await start_engines(1, token_delay_ms=TOKEN_DELAY_MS)
    async with await DpcoordClient.connect(coordinator.settings) as client:
        stream = client.stream("abc", max_tokens=MAX_TOKENS, flow=FlowLimits(BUFFER_BYTES, 0.3), timeout=60)
        request_id = (await anext(stream)).request_id
        await wait_until(lambda: engine.requests.held_back() == [request_id])
        await wait_until(lambda: request_id not in engine.requests)  # aborted: the engine freed it
        with pytest.raises(StreamStalled, match="took nothing for 0.3 s") as raised:
            async for _ in stream:
                pass
        assert raised.value.code == 408
