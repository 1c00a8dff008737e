"""A SIGKILLed coordinator replica costs seconds, not deadlines (docs/reliability.md, adoption).

Three ``dpcoord coordinator`` processes, two in-process echo engines (the documented test
double) with few slots each, so that some requests wait in their replica's queue, and the
client library streaming. The replica that holds the most requests is killed: every request
it held ends, with every token, within ``heartbeat_timeout_s`` + 5 s. Those an engine was
running are adopted by a survivor; those still queued at the dead replica are resubmitted
by the client library once the replica stops heartbeating.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from service.client import DpcoordClient
from service.coordinator.shared_state import bucket_name
from service.ops.settings import Settings
from service.protocol.messages import Final, Partial
from service.protocol.state import ControlRecord, CoordinatorState
from tests.conftest import make_settings
from tests.replicas import EngineSet, ReplicaSet, Status

pytestmark = pytest.mark.timeout(120)
IDS = ("r0", "r1", "r2")
SLOTS = 4
PROMPT = "abcdefghij"
MAX_TOKENS = 60


@pytest.fixture
def settings(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("DPCOORD_MAX_INFLIGHT_PER_ENGINE", str(SLOTS))
    return make_settings(nats_url, max_inflight_per_engine=SLOTS)


@pytest.fixture
async def replicas(settings: Settings, nc: NATS) -> AsyncIterator[ReplicaSet]:
    replica_set = ReplicaSet(settings, nc)
    yield replica_set
    await replica_set.close()


async def test_the_requests_of_a_killed_replica_end_within_seconds_with_every_token(
    settings: Settings, replicas: ReplicaSet, nc: NATS
) -> None:
    await replicas.start(*IDS)
    started = [EngineRuntime(settings, EchoBackend(token_delay_ms=20.0)) for _ in range(2)]
    for engine in started:
        await engine.start()
    try:
        await asyncio.gather(*(asyncio.wait_for(engine.registered.wait(), 10) for engine in started))
        await replicas.wait_for(lambda statuses: all(len(s["engines"]) == 2 for s in statuses.values()), 10)
        await check_a_kill(settings, replicas)
    finally:
        for engine in started:
            await engine.stop()


async def check_a_kill(settings: Settings, replicas: ReplicaSet) -> None:
    expected = [ord(PROMPT[n % len(PROMPT)]) for n in range(MAX_TOKENS)]
    holders: dict[int, str] = {}
    first_partials = asyncio.Event()
    ended: dict[int, float] = {}
    results: dict[int, tuple[list[int], Final]] = {}

    async with await DpcoordClient.connect(settings) as client:

        async def one(n: int) -> None:
            streamed: list[int] = []
            async for reply in client.stream(PROMPT, max_tokens=MAX_TOKENS, timeout=60.0):
                holders[n] = reply.request_id.rpartition("-")[0]
                if len(holders) >= SLOTS * 2:
                    first_partials.set()
                if isinstance(reply, Partial):
                    streamed.extend(reply.new_tokens)
                else:
                    results[n] = (streamed, reply)
            ended[n] = time.monotonic()

        count = SLOTS * 2 * 3  # two thirds wait in their replica's queue at first
        tasks = [asyncio.create_task(one(n)) for n in range(count)]
        await asyncio.wait_for(first_partials.wait(), 20)
        victim, _ = Counter(holders.values()).most_common(1)[0]
        held_by_victim = [n for n, holder in holders.items() if holder == victim]
        replicas.kill(victim)
        killed_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    bound = settings.heartbeat_timeout_s + 5.0
    late = {n: round(ended[n] - killed_at, 2) for n in held_by_victim if ended[n] - killed_at > bound}
    assert not late, f"requests of {victim} ended later than {bound} s after the kill: {late}"
    assert sorted(results) == list(range(count))
    for n, (streamed, final) in results.items():
        # The partials yielded are exact (no duplicate, no other run's); after a gap the final,
        # which carries every token, fills in the rest (service/protocol/streams.py).
        assert final.generated_tokens == expected, n
        assert streamed == expected[: len(streamed)], (n, "".join(chr(token) for token in streamed))


# ---------------------------------------------------------------- stopped, adopted, engine lost

LONG_TOKENS = 150  # 3 s at 20 ms a token: it runs through the stop, the adoption and the loss


async def test_a_stopped_replicas_request_whose_engine_is_then_lost_runs_again(
    settings: Settings, replicas: ReplicaSet, nc: NATS
) -> None:
    """Issue 34, 4: the replica holding a request is stopped (SIGSTOP) until its peer adopts
    the request, the engine running it is then SIGKILLed with nothing streamed, and the stopped
    replica resumes. The request runs again on another engine and ends with its final: no 503
    (the resumed replica once took its own silence for the engines' and lost them all, each
    retry on the next engine it was about to drop)."""
    await replicas.start("r0", "r1")
    engines = EngineSet(settings, token_delay_ms=20.0)
    await engines.spawn("e0", "e1", "e2")
    try:
        await replicas.wait_for(lambda statuses: all(len(s["engines"]) == 3 for s in statuses.values()), 20)
        async with await DpcoordClient.connect(settings) as client:
            running = asyncio.create_task(client.submit(PROMPT, max_tokens=LONG_TOKENS, timeout=60.0))
            statuses = await replicas.wait_for(
                lambda statuses: sum(status["requests_in_flight"] for status in statuses.values()) == 1, 10
            )
            holder = next(rid for rid, status in statuses.items() if status["requests_in_flight"] == 1)
            [engine_id] = [load["engine_id"] for load in statuses[holder]["engines"] if load["in_flight"]]
            peer = next(rid for rid in statuses if rid != holder)
            replicas.processes[holder].send_signal(signal.SIGSTOP)
            try:
                await wait_status(replicas, peer, lambda status: status["counters"].get("requests_adopted", 0) >= 1)
                engines.kill(engine_id)
                await wait_status(replicas, peer, lambda status: status["counters"].get("retried", 0) >= 1)
            finally:
                replicas.processes[holder].send_signal(signal.SIGCONT)
            final = await asyncio.wait_for(running, 30)
    finally:
        await engines.close()
    assert final.generated_tokens == [ord(PROMPT[n % len(PROMPT)]) for n in range(LONG_TOKENS)]
    assert final.engine_id != engine_id


async def test_a_drain_pause_whose_replica_dies_after_writing_the_record_is_still_answered(
    settings: Settings, replicas: ReplicaSet, nc: NATS
) -> None:
    """Issue 34, 3: ``pause`` with mode ``drain`` while a request runs; the replica that took it is
    SIGKILLed as soon as the shared record says ``paused``. The caller still gets its ack, once
    the request has drained: the client library sends the signal again, marked ``retry``, when
    a replica stops heartbeating, and the survivor acknowledges it once every engine confirmed
    (it never came before: the caller waited out its timeout)."""
    await replicas.start("r0", "r1")
    engines = EngineSet(settings, token_delay_ms=20.0)
    await engines.spawn("e0")
    kv = await nc.jetstream().key_value(bucket_name(settings.subject_prefix))
    watcher = await kv.watch(settings.subject_prefix)
    try:
        await replicas.wait_for(lambda statuses: all(len(s["engines"]) == 1 for s in statuses.values()), 20)
        async with await DpcoordClient.connect(settings) as client:
            running = asyncio.create_task(client.submit(PROMPT, max_tokens=LONG_TOKENS, timeout=60.0))
            await replicas.wait_for(
                lambda statuses: sum(status["requests_in_flight"] for status in statuses.values()) == 1, 10
            )
            pausing = asyncio.create_task(client.pause(timeout=20.0, mode="drain"))
            writer = ""
            async for entry in watcher:
                record = msgspec.json.decode(entry.value or b"{}", type=ControlRecord) if entry else None
                if record is not None and record.state is CoordinatorState.PAUSED:
                    writer = record.coordinator_id
                    break
            replicas.kill(writer)
            killed_at = time.monotonic()
            ack = await pausing
            acked_s = time.monotonic() - killed_at
            final = await asyncio.wait_for(running, 20)
    finally:
        await watcher.stop()
        await engines.close()
    print(
        f"\n[control] pause (drain), its replica {writer} SIGKILLed once the record said paused: {ack!r} {acked_s:.1f} s after the kill"
    )
    assert ack.state == "paused" and ack.mode == "drain"
    assert final.finish_reason == "length" and len(final.generated_tokens) == LONG_TOKENS  # drained, not cut


async def wait_status(replicas: ReplicaSet, replica: str, condition: Callable[[Status], bool]) -> None:
    """Until ``replica``'s status satisfies ``condition`` (the others may be stopped)."""

    async def holds() -> None:
        while True:  # remote state: nothing to wait on but the next answer
            if condition(await replicas.status(replica)):
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(holds(), 15)
