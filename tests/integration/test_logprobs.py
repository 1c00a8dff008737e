"""Log-probabilities end to end on a real NATS server with echo engines: the client library's
keywords, its replies' fields (exactly the echo backend's function of token and position), and
400 naming the field for a value out of range, as for other sampling parameters; and an engine
of an earlier release (a test double) never gets such a request, nor a client a final without
what it asked for."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NATS

from benchmarks.doc_engines import DocEngineFleet
from engines.echo import echo_logprob, echo_top_logprobs
from service.cli import fleet_commands
from service.cli.main import build_parser
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect
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


@pytest.fixture
async def old_engine(coordinator: Coordinator, nc: NATS) -> AsyncIterator[DocEngineFleet]:
    """Test double of an engine of an earlier release: written from docs/protocol.md alone
    (benchmarks/doc_engines.py), it announces no features and ignores the logprob fields."""
    fleet = DocEngineFleet(nc, coordinator.subjects.prefix, ["old"], capacity=64, heartbeat_interval_s=0.2)
    await fleet.start()
    await fleet.register()
    yield fleet
    await fleet.leave()


async def test_requests_asking_for_logprobs_go_only_to_engines_that_compute_them(
    settings: Settings, coordinator: Coordinator, old_engine: DocEngineFleet, start_engines: EngineFactory
) -> None:
    [engine] = await start_engines(1)
    async with await DpcoordClient.connect(settings) as client:
        asking = await asyncio.gather(*(client.submit("abc", max_tokens=2, logprobs=1, timeout=10) for _ in range(8)))
        plain = await asyncio.gather(*(client.submit("abc", max_tokens=2, timeout=10) for _ in range(8)))
    assert {final.engine_id for final in asking} == {engine.engine_id}
    assert all(final.token_logprobs == [echo_logprob(97, 3), echo_logprob(98, 4)] for final in asking)
    assert "old" in {final.engine_id for final in plain}  # the old engine still serves the others


async def test_without_an_engine_that_computes_them_a_request_asking_gets_a_clear_503(
    settings: Settings, coordinator: Coordinator, old_engine: DocEngineFleet, nc: NATS
) -> None:
    async with await DpcoordClient.connect(settings) as client:
        with pytest.raises(ClientError) as raised:
            await client.submit("abc", max_tokens=2, prompt_logprobs=0, timeout=10)
        assert (await client.submit("abc", max_tokens=2, timeout=10)).engine_id == "old"
    assert raised.value.code == 503 and "computes log-probabilities" in str(raised.value)
    reply = await request_json(
        nc, coordinator.subjects.coordinator("submit_request"), {"prompt": "x", "sampling_params": {"logprobs": 0}}
    )
    assert reply["type"] == "error" and reply["error"]["code"] == 503


async def test_the_client_library_never_returns_a_final_without_the_logprobs_it_asked_for(
    settings: Settings, coordinator: Coordinator, old_engine: DocEngineFleet
) -> None:
    """Behind a coordinator that routes by no feature (one of an earlier release, which this
    test double of a pool entry stands for), an old engine answers without them."""
    pool = coordinator.engines
    record = pool.get("old")
    assert record is not None and not record.logprobs
    pool.remove("old", departed=False)
    pool.add("old", record.capacity, record.model, record.own_subjects, logprobs=True)
    async with await DpcoordClient.connect(settings) as client:
        with pytest.raises(ClientError) as raised:
            await client.submit("abc", max_tokens=2, logprobs=2, timeout=10)
        with pytest.raises(ClientError):
            [reply async for reply in client.stream("abc", max_tokens=2, logprobs=2, timeout=10)]
    assert raised.value.code == 503 and "engine old answered without the logprobs asked for" in str(raised.value)


async def test_a_migrated_streams_final_carries_every_tokens_logprob(
    coordinator: Coordinator, start_engines: EngineFactory, settings: Settings
) -> None:
    """The coordinator keeps the delivered logprobs as it keeps the delivered tokens, and the
    engine that resumes the stream puts them first in its final."""
    prompt, count = "migrate my logprobs", 60
    [first] = await start_engines(1, token_delay_ms=10)
    partials: list[Partial] = []
    async with await DpcoordClient.connect(settings) as client:
        async for reply in client.stream(prompt, max_tokens=count, logprobs=2, prompt_logprobs=1, timeout=30):
            if isinstance(reply, Final):
                final = reply
                break
            partials.append(reply)
            if len(partials) == 5:
                await start_engines(1, token_delay_ms=10)
                await coordinator.nc.publish(
                    coordinator.subjects.sent_by("disconnect", first.engine_id),
                    encode_msgpack(EngineDisconnect(first.engine_id, "test")),
                )
    data = prompt.encode()
    tokens = [data[n % len(data)] for n in range(count)]
    assert final.engine_id != first.engine_id and partials[-1].attempt == 1 and final.generated_tokens == tokens
    positions = range(len(data), len(data) + count)
    assert final.token_logprobs == [echo_logprob(token, p) for token, p in zip(tokens, positions, strict=True)]
    assert final.top_logprobs == [echo_top_logprobs(token, p, 2) for token, p in zip(tokens, positions, strict=True)]
    assert [value for partial in partials for value in partial.token_logprobs or ()] == final.token_logprobs
    assert final.prompt_token_ids == list(data) and final.token_bytes is not None
    assert set(tokens) | {token + 1 for token in tokens} | set(data) <= set(final.token_bytes)


async def test_dpcoord_submit_prints_the_logprobs(
    settings: Settings,
    start_engines: EngineFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the final's JSON always; on a terminal also a line per token, the prompt's first."""
    await start_engines(1)
    args = build_parser().parse_args(
        ["submit", "hey", "--max-tokens", "2", "--logprobs", "2", "--prompt-logprobs", "1"]
    )
    assert await fleet_commands.submit(settings, args) == 0
    final = msgspec.json.decode(capsys.readouterr().out.strip(), type=Final)
    assert final.token_logprobs == [echo_logprob(ord("h"), 3), echo_logprob(ord("e"), 4)]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert await fleet_commands.submit(settings, args) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "prompt:",
        "     0                      'h'",
        "     1     -0.8750  41.69%  'e'          | 'e' -0.8750",
        "     2     -1.5000  22.31%  'y'          | 'y' -1.5000",
        "generated:",
        "     0     -1.5000  22.31%  'h'          | 'h' -1.5000  'i' -1.6250",
        "     1     -1.2500  28.65%  'e'          | 'e' -1.2500  'f' -1.3750",
    ]
