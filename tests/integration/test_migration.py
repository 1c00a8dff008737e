"""Streams that outlive their engine: a streamed request whose engine leaves or dies continues on
another engine from the exact token (a new run, ``attempt`` + 1), up to ``max_migrations``
times; beyond it the stream ends with a clear 503. Echo engines, whose tokens are known in
advance, so each stream is compared exactly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError

from engines.runtime import EngineRuntime
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineDisconnect
from service.protocol.messages import Final, Partial, SamplingParams, SubmitRequest
from service.protocol.routed import EngineReplyBatch, ReturnPath, RoutedRequest, RoutedRequestBatch
from tests.conftest import EngineFactory
from tests.helpers import REPO_ROOT

PROMPT = "migrate me, exactly"
TOKENS = 120


def echo_of(prompt: str, count: int) -> tuple[list[int], str]:
    """What the echo engine generates for ``prompt``: its bytes, over and over."""
    data = prompt.encode()
    tokens = [data[i % len(data)] for i in range(count)]
    return tokens, bytes(tokens).decode()


async def depart(coordinator: Coordinator, engine_id: str) -> None:
    """Tell the coordinator ``engine_id`` left, as its own disconnect would (it keeps running)."""
    await coordinator.nc.publish(
        coordinator.subjects.sent_by("disconnect", engine_id), encode_msgpack(EngineDisconnect(engine_id, "test"))
    )


def holder(coordinator: Coordinator, engines: list[EngineRuntime]) -> EngineRuntime:
    """The engine the coordinator routed the one request in flight to."""
    [engine] = [
        engine for engine in engines if (record := coordinator.engines.get(engine.engine_id)) and record.requests
    ]
    return engine


async def test_a_stream_whose_engine_leaves_continues_on_another_from_the_exact_token(
    coordinator: Coordinator, start_engines: EngineFactory, settings: Settings
) -> None:
    [first] = await start_engines(1, token_delay_ms=10)
    partials: list[Partial] = []
    async with await DpcoordClient.connect(settings) as client:
        replies = client.stream(PROMPT, max_tokens=TOKENS, timeout=30)
        async for reply in replies:
            if isinstance(reply, Final):
                final = reply
                break
            partials.append(reply)
            if len(partials) == 5:
                [second] = await start_engines(1, token_delay_ms=10)
                await depart(coordinator, first.engine_id)
    tokens, text = echo_of(PROMPT, TOKENS)
    assert [token for item in partials for token in item.new_tokens] == tokens
    assert "".join(item.text for item in partials) == text
    assert [item.offset for item in partials] == list(range(TOKENS))
    attempts = [item.attempt for item in partials]
    assert attempts == sorted(attempts) and attempts[0] == 0 and attempts[-1] == 1
    assert final.generated_tokens == tokens and final.generated_text == text
    assert final.engine_id == second.engine_id and final.finish_reason == "length"
    assert [(span.start, span.end) for span in final.epochs or ()] == [(0, TOKENS)]
    assert coordinator.counters["migrated"] == 1


async def test_max_migrations_spent_ends_the_stream_with_a_clear_503(
    coordinator: Coordinator, start_engines: EngineFactory, settings: Settings
) -> None:
    coordinator.settings.max_migrations = 1
    engines = await start_engines(1, token_delay_ms=10)
    received = 0
    async with await DpcoordClient.connect(settings) as client:
        with pytest.raises(ClientError) as raised:
            async for reply in client.stream(PROMPT, max_tokens=1000, timeout=30):
                assert isinstance(reply, Partial)
                received += 1
                if received in (5, 10):
                    lost = holder(coordinator, engines)
                    engines += await start_engines(1, token_delay_ms=10)
                    await depart(coordinator, lost.engine_id)
    assert raised.value.code == 503
    assert "max_migrations (1)" in raised.value.message and lost.engine_id in raised.value.message
    assert coordinator.counters["migrated"] == 1 and coordinator.counters["migrations_refused"] == 1


def engine_process(settings: Settings) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        DPCOORD_NATS_URL=settings.nats_url,
        DPCOORD_SUBJECT_PREFIX=settings.subject_prefix,
        DPCOORD_HEARTBEAT_INTERVAL_S=str(settings.heartbeat_interval_s),
        DPCOORD_LOG_LEVEL="WARNING",
    )
    command = [sys.executable, "-m", "service", "engine", "--backend", "echo", "--token-delay-ms", "10"]
    return subprocess.Popen(command, env=env, cwd=REPO_ROOT)


@pytest.mark.timeout(120)
async def test_a_stream_whose_engine_is_sigkilled_continues_exactly(
    coordinator: Coordinator, start_engines: EngineFactory, settings: Settings
) -> None:
    """The engine process dies without a word: the coordinator notices its silence and the
    stream resumes on the engine that is left."""
    doomed = engine_process(settings)
    try:
        await coordinator.wait_for_engines(1, timeout_s=60)
        partials: list[Partial] = []
        async with await DpcoordClient.connect(settings) as client:
            async for reply in client.stream(PROMPT, max_tokens=TOKENS * 2, timeout=60):
                if isinstance(reply, Final):
                    final = reply
                    break
                partials.append(reply)
                if len(partials) == 5:
                    [survivor] = await start_engines(1, token_delay_ms=10)
                    doomed.send_signal(signal.SIGKILL)
        tokens, text = echo_of(PROMPT, TOKENS * 2)
        assert "".join(item.text for item in partials) == text == final.generated_text
        assert [item.offset for item in partials] == list(range(TOKENS * 2))
        assert final.generated_tokens == tokens and final.engine_id == survivor.engine_id
        assert partials[-1].attempt == 1 and coordinator.counters["migrated"] == 1
    finally:
        if doomed.poll() is None:
            doomed.kill()
        await asyncio.to_thread(doomed.wait)


async def test_an_engine_routed_a_newer_run_of_a_request_it_holds_replaces_the_older_one(
    coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """A migration can come back to an engine still running the older run (it was cut off, not
    dead): the newer run replaces it without a final, and a repeat of the same run is ignored.
    Driven on the engine's own subject, its replies read on the wire."""
    [engine] = await start_engines(1, token_delay_ms=10)
    finals = await nc.subscribe(coordinator.subjects.sent_by("engine_reply", engine.engine_id))
    path = ReturnPath("r-twice", "c-elsewhere", nc.new_inbox(), "msgpack", True, None)
    body = encode_msgpack(SubmitRequest(PROMPT, SamplingParams(max_tokens=TOKENS), stream=True))
    subject = coordinator.subjects.engine(engine.engine_id, "submit_request")
    await nc.publish(subject, encode_msgpack(RoutedRequestBatch([RoutedRequest(path, body)])))
    await nc.publish(subject, encode_msgpack(RoutedRequestBatch([RoutedRequest(path, body)])))
    tokens, text = echo_of(PROMPT, TOKENS)
    resumed = RoutedRequest(path, body, attempt=1, resume_tokens=tokens[:7])
    await nc.publish(subject, encode_msgpack(RoutedRequestBatch([resumed])))
    [reply] = msgspec.msgpack.decode((await finals.next_msg(timeout=10)).data, type=EngineReplyBatch).replies
    final = msgspec.msgpack.decode(reply.body, type=Final)
    assert reply.attempt == 1 and final.generated_tokens == tokens and final.generated_text == text
    assert engine.counters["runs_superseded"] == 1
    with pytest.raises(NatsTimeoutError):
        await finals.next_msg(timeout=0.5)  # the older run ended without a final
