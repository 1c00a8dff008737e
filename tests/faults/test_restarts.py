"""Coordinator restarts and replicas, engine death detection, client-side limits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.helpers import REPO_ROOT, decode_reply, engines_become


@pytest.fixture
async def slow_engine(settings: Settings) -> AsyncIterator[EngineRuntime]:
    async with EngineRuntime(settings, EchoBackend(token_delay_ms=30)) as engine:
        yield engine


async def crash(coordinator: Coordinator) -> None:
    """Gone without a word: no error replies, no unsubscribe, just the connection dropped."""
    await coordinator.nc.close()


async def read_stream(sub: object) -> list[dict]:
    replies = []
    while (msg := await sub.next_msg(timeout=10)).data:  # type: ignore[attr-defined]
        replies.append(decode_reply(msg.data))
    return replies


async def test_answers_computed_by_engines_reach_clients_after_coordinator_restart(
    settings: Settings, slow_engine: EngineRuntime, nc: NATS
) -> None:
    first = Coordinator(settings, HANDLERS)
    await first.start()
    await asyncio.wait_for(slow_engine.registered.wait(), 10)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"prompt": "survive", "stream": True, "sampling_params": {"max_tokens": 40}}
    await nc.publish(first.subjects.coordinator("submit_request"), json.dumps(body).encode(), reply=inbox)
    assert decode_reply((await sub.next_msg(timeout=5)).data)["type"] == "partial"
    await crash(first)
    async with Coordinator(settings, HANDLERS) as second:
        replies = await read_stream(sub)
        assert replies[-1]["type"] == "final" and replies[-1]["engine_id"] == slow_engine.engine_id
        assert replies[-1]["generated_text"] == ("survive" * 6)[:40]
        assert second.counters["requests_adopted"] == 1  # the new replica adopted the dead one's request
        await second.wait_for_engines(1)
        final = decode_reply(
            (await nc.request(second.subjects.coordinator("submit_request"), b'{"prompt": "new"}', timeout=10)).data
        )
        assert final["type"] == "final"


async def test_two_live_replicas_deliver_each_reply_once(
    settings: Settings, slow_engine: EngineRuntime, nc: NATS
) -> None:
    async with Coordinator(settings, HANDLERS) as first, Coordinator(settings, HANDLERS) as second:
        await first.wait_for_engines(1)
        await second.wait_for_engines(1)
        await asyncio.sleep(0)
        inboxes = [nc.new_inbox() for _ in range(6)]
        subs = [await nc.subscribe(inbox) for inbox in inboxes]
        body = json.dumps({"prompt": "ab", "stream": True, "sampling_params": {"max_tokens": 5}}).encode()
        for inbox in inboxes:
            await nc.publish(first.subjects.coordinator("submit_request"), body, reply=inbox)
        for sub in subs:
            replies = await read_stream(sub)
            assert [reply["type"] for reply in replies] == ["partial"] * 5 + ["final"]
        await nc.request(first.subjects.coordinator("submit_request"), b'{"prompt": "barrier"}', timeout=5)
        assert all(sub.pending_msgs == 0 for sub in subs)
        assert first.counters["submitted"] + second.counters["submitted"] == 7


async def test_client_retries_while_no_coordinator_listens(settings: Settings, slow_engine: EngineRuntime) -> None:
    first = Coordinator(settings, HANDLERS)
    await first.start()
    async with await DpcoordClient.connect(settings) as client:
        await first.stop()
        submission = asyncio.create_task(client.submit("patient", max_tokens=3, timeout=20))
        await asyncio.sleep(0.3)  # let it meet no-responders a few times: that is the point
        assert not submission.done()
        async with Coordinator(settings, HANDLERS):
            final = await submission
    assert final.generated_text == "pat"


async def test_oversize_submission_is_413_on_the_client(settings: Settings) -> None:
    async with Coordinator(settings, HANDLERS), await DpcoordClient.connect(settings) as client:
        with pytest.raises(ClientError) as caught:
            await client.submit("x" * (client.nc.max_payload + 1))
    assert caught.value.code == 413 and str(client.nc.max_payload) in caught.value.message


def test_sigkilled_engine_is_detected_within_the_heartbeat_timeout(nats_url: str) -> None:
    """Default heartbeat settings (1 s beats, 3 s timeout): the detection time a user gets."""
    settings = Settings(nats_url=nats_url, subject_prefix=f"kill{os.getpid()}")

    async def scenario() -> float:
        async with Coordinator(settings, HANDLERS) as coordinator:
            env = dict(os.environ, DPCOORD_NATS_URL=nats_url, DPCOORD_SUBJECT_PREFIX=settings.subject_prefix)
            engine = subprocess.Popen(
                [sys.executable, "-m", "service", "engine", "--backend", "echo"], env=env, cwd=REPO_ROOT
            )
            try:
                await coordinator.wait_for_engines(1, timeout_s=30)
                engine.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                await engines_become(coordinator, 0, timeout_s=10)
                return time.monotonic() - killed_at
            finally:
                engine.kill()
                engine.wait()

    detection_s = asyncio.run(scenario())
    print(f"\nSIGKILLed engine removed after {detection_s:.2f} s (heartbeat_timeout_s={settings.heartbeat_timeout_s})")
    assert detection_s <= settings.heartbeat_timeout_s + settings.heartbeat_timeout_s / 4 + 0.5
