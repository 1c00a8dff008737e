from __future__ import annotations

from nats.aio.client import Client as NATS

from service.coordinator import Coordinator
from tests.conftest import EngineFactory
from tests.helpers import request_json


async def test_submit_json_round_trip(coordinator: Coordinator, start_engines: EngineFactory, nc: NATS) -> None:
    await start_engines(2)
    reply = await request_json(nc, coordinator.subjects.coordinator("submit_request"), {"prompt": "abc", "sampling_params": {"max_tokens": 5}})
    assert reply["type"] == "final"
    assert reply["generated_text"] == "abcab"
    assert reply["finish_reason"] == "length"
