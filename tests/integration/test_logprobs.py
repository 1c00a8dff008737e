"""Log-probabilities end to end on a real NATS server with echo engines: the client library's
keywords, its replies' fields (exactly the echo backend's function of token and position), and
400 naming the field for a value out of range, as for other sampling parameters."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS

from engines.echo import echo_logprob, echo_top_logprobs
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.messages import Final, Partial
from tests.conftest import EngineFactory
from tests.helpers import request_json


async def test_the_client_library_streams_logprobs_aligned_with_tokens_and_the_final_holds_all(
    settings: Settings, start_engines: EngineFactory
) -> None:
    await start_engines(1)
    async with await DpcoordClient.connect(settings) as client:
        replies = [
            reply async for reply in client.stream("hello", max_tokens=4, logprobs=3, prompt_logprobs=1, timeout=10)
        ]
        final = await client.submit("hello", max_tokens=4, logprobs=3, logprobs_mode="processed", timeout=10)
    partials = [reply for reply in replies if isinstance(reply, Partial)]
    streamed = replies[-1]
    assert isinstance(streamed, Final) and partials
    tokens = list(b"hell")
    logprobs = [echo_logprob(token, 5 + n) for n, token in enumerate(tokens)]
    top = [echo_top_logprobs(token, 5 + n, 3) for n, token in enumerate(tokens)]
    assert [lp for partial in partials for lp in partial.token_logprobs or ()] == logprobs
    assert [alts for partial in partials for alts in partial.top_logprobs or ()] == top
    for partial in partials:
        assert partial.token_bytes is not None and set(partial.new_tokens) <= set(partial.token_bytes)
    for reply in (streamed, final):
        assert reply.generated_tokens == tokens
        assert reply.token_logprobs == logprobs and reply.top_logprobs == top
        assert reply.token_bytes is not None and reply.token_bytes[ord("h")] == b"h"
    assert streamed.prompt_token_ids == list(b"hello")
    assert streamed.prompt_logprobs == [None, *(echo_logprob(token, p) for p, token in enumerate(b"hello") if p)]
    assert final.prompt_logprobs is None  # not asked


async def test_a_request_without_logprobs_gets_replies_without_them(
    settings: Settings, start_engines: EngineFactory
) -> None:
    await start_engines(1)
    async with await DpcoordClient.connect(settings) as client:
        replies = [reply async for reply in client.stream("hi", max_tokens=2, timeout=10)]
    assert all(reply.token_logprobs is None and reply.token_bytes is None for reply in replies)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"logprobs": 21}, "$.sampling_params.logprobs"),
        ({"logprobs": -1}, "$.sampling_params.logprobs"),
        ({"prompt_logprobs": 21}, "$.sampling_params.prompt_logprobs"),
        ({"logprobs_mode": "softmax"}, "$.sampling_params.logprobs_mode"),
    ],
)
async def test_out_of_range_values_get_400_naming_the_field(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS, params: dict[str, object], field: str
) -> None:
    await start_engines(1)
    reply = await request_json(
        nc, coordinator.subjects.coordinator("submit_request"), {"prompt": "x", "sampling_params": params}
    )
    assert reply["type"] == "error" and reply["error"]["code"] == 400 and field in reply["error"]["message"]


async def test_the_client_library_gets_400_naming_the_field_from_the_engine(
    settings: Settings, start_engines: EngineFactory
) -> None:
    await start_engines(1)
    async with await DpcoordClient.connect(settings) as client:
        with pytest.raises(ClientError) as raised:
            await client.submit("x", logprobs=21, timeout=10)
    assert raised.value.code == 400 and "sampling_params.logprobs" in str(raised.value)
