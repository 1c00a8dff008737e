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
from service.client import DpcoordClient, StreamStalled
from service.coordinator.coordinator import Coordinator
from tests.gateway_helpers import wait_until

BUFFER_BYTES = 8192  # some 45 one-token partials


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
        stream = client.stream("abc", max_tokens=1_000_000, buffer_bytes=BUFFER_BYTES, stall_timeout=60, timeout=60)
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
