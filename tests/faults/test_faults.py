"""The fault suite: load, an engine SIGKILLed, the NATS server restarted and garbage on every
subject, then a count of terminal replies; once more with three coordinator replicas. Run alone
with `pytest -m faults -s`.

Core NATS delivers at most once, so a client that must lose nothing resubmits what may have
been lost, under the same (client_id, client_request_id): after a reconnect, and on NATS's
no-responders status. The first run does that by hand on the wire and checks that every
request ends with one terminal outcome (a resubmission may bring the same answer again,
counted as 'repeated'; two different answers would be 'conflicting'). The second run goes
through the client library, which does it for the caller, and checks lost 0, duplicated 0
and that no request ran twice."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from engines.backend import GenerationRequest
from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.bus.server import EmbeddedNatsServer
from service.client import ClientError, DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.subjects import ENGINE_HEADERS, Header
from tests.conftest import make_settings
from tests.helpers import REPO_ROOT, decode_reply
from tests.replicas import ReplicaSet

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]
REQUESTS = 2000
IN_FLIGHT = 200


@pytest.fixture
def private_nats() -> Iterator[EmbeddedNatsServer]:
    """A server of this test's own, since it gets restarted."""
    with EmbeddedNatsServer() as server:
        yield server


def fault_settings(server: EmbeddedNatsServer, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "heartbeat_interval_s": 0.3,
        "heartbeat_timeout_s": 1.5,
        "request_timeout_s": 15.0,
        "reconnect_grace_s": 1.0,
        "control_timeout_s": 3.0,
    }
    return make_settings(server.url, **{**values, **overrides})


def engine_process(settings: Settings) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        DPCOORD_NATS_URL=settings.nats_url,
        DPCOORD_SUBJECT_PREFIX=settings.subject_prefix,
        DPCOORD_HEARTBEAT_INTERVAL_S=str(settings.heartbeat_interval_s),
        DPCOORD_HEARTBEAT_TIMEOUT_S=str(settings.heartbeat_timeout_s),
        DPCOORD_LOG_LEVEL="WARNING",
    )
    command = [sys.executable, "-m", "service", "engine", "--backend", "echo", "--token-delay-ms", "5"]
    return subprocess.Popen(command, env=env, cwd=REPO_ROOT)


async def restart_nats(server: EmbeddedNatsServer) -> None:
    await asyncio.to_thread(server.restart)


async def publish_garbage(nc: NATS, settings: Settings, engine_ids: list[str], count: int) -> None:
    """Bytes no decoder accepts (0xc1 is never valid msgpack; '{' opens broken JSON)."""
    rng = random.Random(7)
    prefix = settings.subject_prefix
    subjects = [f"{prefix}.{header}" for header in Header if header not in ENGINE_HEADERS]
    subjects += [f"{prefix}.{header}.{engine_id}" for header in ENGINE_HEADERS for engine_id in engine_ids]
    subjects += [f"{prefix}.engine.{engine_id}.submit_request" for engine_id in engine_ids]
    subjects += [f"{prefix}.engines.{header}" for header in Header]
    for i in range(count):
        body = (b"\xc1" if i % 2 else b"{") + rng.randbytes(rng.randint(0, 200))
        try:
            await nc.publish(rng.choice(subjects), body, reply=f"_INBOX.garbage.{i}")
        except nats.errors.ConnectionClosedError:
            return
        if i % 20 == 0:
            await asyncio.sleep(0.01)


def msgspec_key(reply: dict) -> str:
    """One terminal outcome: the same request_id and content means the same answer, sent again."""
    return json.dumps(reply, sort_keys=True)


def print_counts(title: str, counts: dict[str, int]) -> None:
    line = ", ".join(f"{key} {value}" for key, value in counts.items())
    print(f"\n[fault suite] {title}: {line}")


async def test_wire_clients_get_exactly_one_terminal_reply_through_faults(private_nats: EmbeddedNatsServer) -> None:
    settings = fault_settings(private_nats)
    engines = [engine_process(settings) for _ in range(3)]
    try:
        async with Coordinator(settings, HANDLERS) as coordinator:
            await coordinator.wait_for_engines(3, timeout_s=30)
            engine_ids = [record.engine_id for record in coordinator.engines]
            outstanding: dict[int, bytes] = {}

            async def resubmit_outstanding() -> None:
                """The public recovery contract: a named client repeats what it has no answer for."""
                for index, body in list(outstanding.items()):
                    await client.publish(submit_subject, body, reply=f"_INBOX.fault.{index}")

            client = await nats.connect(
                settings.nats_url,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.2,
                reconnected_cb=resubmit_outstanding,
            )
            submit_subject = f"{settings.subject_prefix}.submit_request"
            replies: dict[int, list[Msg]] = defaultdict(list)
            done: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(REQUESTS)}
            streamed = {i: i % 2 == 0 for i in range(REQUESTS)}

            retrying: set[int] = set()
            retries: set[asyncio.Task[None]] = set()

            async def retry_later(index: int, reply: str) -> None:
                await asyncio.sleep(0.1)
                retrying.discard(index)
                if index in outstanding:
                    await client.publish(submit_subject, outstanding[index], reply=reply)

            async def on_reply(msg: Msg) -> None:
                index = int(msg.subject.rsplit(".", 1)[1])
                if not msg.data and msg.headers and msg.headers.get("Status") == "503":
                    # No coordinator subscribed right now (it is reconnecting): one retry at a time,
                    # scheduled, so this subscription keeps reading replies meanwhile.
                    if index in outstanding and index not in retrying:
                        retrying.add(index)
                        retries.add(asyncio.create_task(retry_later(index, msg.subject)))
                    return
                replies[index].append(msg)
                if not msg.data if streamed[index] else True:
                    outstanding.pop(index, None)
                    done[index].set()

            await client.subscribe("_INBOX.fault.>", cb=on_reply)
            slots = asyncio.Semaphore(IN_FLIGHT)

            async def submit(index: int) -> None:
                async with slots:
                    if index == REQUESTS // 4:
                        kill_now.set()
                    if index == REQUESTS // 2:
                        restart_now.set()
                    body = {
                        "prompt": f"request {index}",
                        "stream": streamed[index],
                        "client_id": "raw-client",
                        "client_request_id": index,
                        "sampling_params": {"max_tokens": 4 + index % 9},
                    }
                    outstanding[index] = json.dumps(body).encode()
                    await client.publish(submit_subject, outstanding[index], reply=f"_INBOX.fault.{index}")
                    try:
                        await asyncio.wait_for(done[index].wait(), settings.request_timeout_s + 15)
                    except TimeoutError:
                        pass

            kill_now, restart_now = asyncio.Event(), asyncio.Event()

            async def chaos() -> None:
                await kill_now.wait()
                engines[0].send_signal(signal.SIGKILL)
                await publish_garbage(client, settings, engine_ids, 300)
                await restart_now.wait()
                await restart_nats(private_nats)
                await publish_garbage(client, settings, engine_ids, 300)

            await asyncio.gather(chaos(), *(submit(i) for i in range(REQUESTS)))

            outcomes: Counter[str] = Counter()
            for index in range(REQUESTS):
                terminals = [decode_reply(msg.data) for msg in replies[index] if msg.data]
                terminals = [reply for reply in terminals if reply["type"] in ("final", "error")]
                distinct = {msgspec_key(reply) for reply in terminals}
                if not terminals:
                    outcomes["lost"] += 1
                elif len(distinct) > 1:
                    outcomes["conflicting"] += 1
                else:
                    outcomes[terminals[0]["type"]] += 1
                    outcomes["repeated"] += len(terminals) - 1
            counts = {
                "submitted": REQUESTS,
                "final": outcomes["final"],
                "error": outcomes["error"],
                "lost": outcomes["lost"],
                "conflicting": outcomes["conflicting"],
                "repeated (answers to own resubmissions)": outcomes["repeated"],
            }
            print_counts("wire-level clients, engine SIGKILL + NATS restart + garbage", counts)
            print_counts("coordinator counters", dict(sorted(coordinator.counters.items())))
            assert outcomes["lost"] == 0 and outcomes["conflicting"] == 0
            assert outcomes["final"] > REQUESTS // 2

            check = await DpcoordClient.connect(settings, nc=client)
            assert (await check.submit("still here", max_tokens=3, timeout=10)).generated_text == "sti"
            await client.close()
    finally:
        for engine in engines:
            if engine.poll() is None:
                engine.send_signal(signal.SIGTERM)
        for engine in engines:
            try:
                engine.wait(timeout=10)
            except subprocess.TimeoutExpired:
                engine.kill()


class RecordingEcho(EchoBackend):
    """Echo that records every prompt it is asked to run, to prove nothing runs twice."""

    def __init__(self, runs: Counter[str]) -> None:
        super().__init__(token_delay_ms=5)
        self._runs = runs

    def add(self, request: GenerationRequest) -> int:
        self._runs[str(request.prompt)] += 1
        return super().add(request)


async def submit_counted(client: DpcoordClient, prompt: str, index: int, outcomes: Counter[str]) -> None:
    """One request through the client library, odd ones whole and even ones streamed; its
    outcome is counted: final, empty, duplicated (more than one final), error_<code> or lost."""
    try:
        if index % 2:
            final = await client.submit(prompt, max_tokens=4 + index % 9, timeout=40)
            outcomes["final" if final.generated_text else "empty"] += 1
            return
        finals = [
            reply
            async for reply in client.stream(prompt, max_tokens=4 + index % 9, timeout=40)
            if reply.__class__.__name__ == "Final"
        ]
        outcomes["final" if len(finals) == 1 else "duplicated"] += 1
    except ClientError as exc:
        outcomes[f"error_{exc.code}"] += 1
    except TimeoutError:
        outcomes["lost"] += 1


async def test_client_library_loses_nothing_across_a_nats_restart(private_nats: EmbeddedNatsServer) -> None:
    settings = fault_settings(private_nats, heartbeat_timeout_s=3.0)
    runs: Counter[str] = Counter()
    async with Coordinator(settings, HANDLERS) as coordinator:
        engines = [EngineRuntime(settings, RecordingEcho(runs)) for _ in range(2)]
        for engine in engines:
            await engine.start()
        await coordinator.wait_for_engines(2)
        outcomes: Counter[str] = Counter()
        async with await DpcoordClient.connect(settings) as client:
            slots = asyncio.Semaphore(IN_FLIGHT)
            restart_at = asyncio.Event()

            async def one(index: int) -> None:
                async with slots:
                    if index == REQUESTS // 2:
                        restart_at.set()
                    await submit_counted(client, f"library request {index}", index, outcomes)

            async def restart() -> None:
                await restart_at.wait()
                await restart_nats(private_nats)

            await asyncio.gather(restart(), *(one(i) for i in range(REQUESTS)))
        run_twice = sum(1 for count in runs.values() if count > 1)
        errors = sum(count for key, count in outcomes.items() if key.startswith("error"))
        print_counts(
            "client library, NATS restart mid-load",
            {
                "submitted": REQUESTS,
                "final": outcomes["final"],
                "error": errors,
                "lost": outcomes["lost"],
                "duplicated": outcomes["duplicated"],
                "run twice": run_twice,
            },
        )
        print_counts("coordinator counters", dict(sorted(coordinator.counters.items())))
        for engine in engines:
            await engine.stop()
    assert outcomes["lost"] == 0 and outcomes["duplicated"] == 0 and run_twice == 0
    assert outcomes["final"] + errors == REQUESTS


async def test_three_replicas_lose_nothing_through_an_engine_kill_and_a_nats_restart(
    private_nats: EmbeddedNatsServer,
) -> None:
    """Three coordinator replicas and three engines as processes, the client library under load,
    an engine SIGKILLed and the NATS server restarted. Then the replicas still share one control
    state: the bucket survived the restart (its store is on disk) and every replica follows it."""
    settings = fault_settings(private_nats, heartbeat_timeout_s=3.0)
    requests, in_flight = REQUESTS // 2, IN_FLIGHT // 2
    observer = await nats.connect(settings.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    replicas = ReplicaSet(settings, observer)
    engines = [engine_process(settings) for _ in range(3)]
    try:
        await replicas.start("r0", "r1", "r2")
        await replicas.wait_for(lambda statuses: all(len(s["engines"]) == 3 for s in statuses.values()), 30)
        outcomes: Counter[str] = Counter()
        async with await DpcoordClient.connect(settings) as client:
            slots = asyncio.Semaphore(in_flight)
            kill_now, restart_now = asyncio.Event(), asyncio.Event()

            async def one(index: int) -> None:
                async with slots:
                    if index == requests // 4:
                        kill_now.set()
                    if index == requests // 2:
                        restart_now.set()
                    await submit_counted(client, f"replicated request {index}", index, outcomes)

            async def chaos() -> None:
                await kill_now.wait()
                engines[0].send_signal(signal.SIGKILL)
                await restart_now.wait()
                await restart_nats(private_nats)

            await asyncio.gather(chaos(), *(one(i) for i in range(requests)))
            _, revision_before = await replicas.record()
            # Control after the restart: taken by any replica, followed by all.
            assert (await client.pause(timeout=20)).state == "paused"
            await replicas.all_report(10, state="paused")
            assert (await client.unpause(timeout=20)).state == "running"
            await replicas.all_report(10, state="running")
            _, revision_after = await replicas.record()
            counters: Counter[str] = Counter()
            for status in (await replicas.statuses()).values():
                counters.update(status["counters"])
        errors = {key: count for key, count in outcomes.items() if key.startswith("error")}
        print_counts(
            "three replicas, client library, engine SIGKILL + NATS restart",
            {
                "replicas": 3,
                "submitted": requests,
                "final": outcomes["final"],
                "error": sum(errors.values()),
                "lost": outcomes["lost"],
                "duplicated": outcomes["duplicated"],
            },
        )
        print_counts("replica counters, summed", dict(sorted(counters.items())))
        assert outcomes["lost"] == 0 and outcomes["duplicated"] == 0 and outcomes["empty"] == 0
        assert outcomes["final"] + sum(errors.values()) == requests
        assert set(errors) <= {"error_503"}  # streamed requests on the killed engine
        assert revision_after == revision_before + 2  # the bucket kept its history across the restart
    finally:
        await replicas.close()
        await observer.close()
        for engine in engines:
            if engine.poll() is None:
                engine.send_signal(signal.SIGTERM)
        for engine in engines:
            try:
                engine.wait(timeout=10)
            except subprocess.TimeoutExpired:
                engine.kill()
