"""A submission held by a pause says why it waits (docs/protocol.md, *Held*): the coordinator
tells a client that asked (``SubmitEnvelope.held_notices``) with one ``Held`` notice, the client
library hands it to ``on_held``, and ``dpcoord submit`` says ``held: the fleet is paused``."""

from __future__ import annotations

import asyncio
import os
import sys

import msgspec
from nats.aio.client import Client as NATS

from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.messages import Final, Held, Reply, SamplingParams, SubmitEnvelope, SubmitRequest
from tests.conftest import EngineFactory
from tests.helpers import REPO_ROOT, until


async def test_a_submission_held_by_a_pause_hears_why_once_then_runs(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(1)
    async with await DpcoordClient.connect(settings) as client:
        await client.pause()
        heard: list[Held] = []
        running = asyncio.ensure_future(client.submit("hi", max_tokens=2, on_held=heard.append))
        await until(lambda: bool(heard), 10)
        assert not running.done() and coordinator.queued == 1
        await client.unpause()
        final = await asyncio.wait_for(running, 10)
    assert heard == [Held(final.request_id, heard[0].client_request_id, "paused")]


async def test_only_a_client_that_asked_gets_a_notice(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """Clients of earlier releases (and ``nats request``) read no ``Held``: they get none."""
    await start_engines(1)
    async with await DpcoordClient.connect(settings) as client:
        await client.pause()
        subject = coordinator.subjects.coordinator("submit_request")
        inbox = nc.new_inbox()
        subscription = await nc.subscribe(f"{inbox}.*")
        body = encode_msgpack(SubmitRequest("hi", SamplingParams(max_tokens=2)))
        for token, asked in (("old", False), ("new", True)):
            envelope = SubmitEnvelope(1, body, False, token, "raw", held_notices=asked)
            await nc.publish(subject, encode_msgpack(envelope), reply=f"{inbox}.{token}")
        await until(lambda: coordinator.queued == 2, 10)
        await client.unpause()
        decoder = msgspec.msgpack.Decoder(Reply)
        got = [decoder.decode((await subscription.next_msg(timeout=10)).data) for _ in range(3)]
    assert [type(reply) for reply in got] == [Held, Final, Final]
    assert got[0].client_request_id == "new"  # type: ignore[union-attr]


async def test_dpcoord_submit_says_the_fleet_is_paused(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(1)
    env = dict(os.environ, DPCOORD_NATS_URL=settings.nats_url, DPCOORD_SUBJECT_PREFIX=settings.subject_prefix)
    async with await DpcoordClient.connect(settings) as client:
        await client.pause()
        submit = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "submit", "Hi", "--max-tokens", "2",
            env=env, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert submit.stderr is not None and submit.stdout is not None
        try:
            line = await asyncio.wait_for(submit.stderr.readline(), 30)
            assert line == b"held: the fleet is paused\n"
            await client.unpause()
            out = await asyncio.wait_for(submit.stdout.read(), 30)
        finally:
            if submit.returncode is None:
                submit.kill()
            await submit.wait()
    assert b'"finish_reason":"length"' in out
