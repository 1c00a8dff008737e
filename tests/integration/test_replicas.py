"""Three coordinator replicas as separate processes share one control state (JetStream KV).

Each replica is a ``dpcoord coordinator`` process on the session's nats-server, which runs
with JetStream; engines are in-process echo engines. The queue group hands each signal to
one replica at random, so a test that must reach every replica sends until each one's own
status shows it was reached. Replicas are observed through their status endpoints
(``<prefix>.status.coordinator.<id>``) and the bucket itself. The last tests run a server
without JetStream: one coordinator works, a second refuses to start.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.bus.server import EmbeddedNatsServer
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.errors import WireError
from service.protocol.membership import CoordinatorHeartbeat
from service.protocol.state import CoordinatorState, decide
from service.protocol.subjects import Header
from tests.conftest import make_settings
from tests.helpers import decode_reply, request_json
from tests.replicas import ReplicaSet, Status

pytestmark = pytest.mark.timeout(90)
IDS = ("r0", "r1", "r2")
# The promise: a replica's status shows the shared state within this long of the ack.
STATUS_WITHIN_S = 1.0

Engines = Callable[[int], Awaitable[list[EngineRuntime]]]


@pytest.fixture
async def replicas(settings: Settings, nc: NATS) -> AsyncIterator[ReplicaSet]:
    replica_set = ReplicaSet(settings, nc)
    yield replica_set
    await replica_set.close()


@pytest.fixture
async def engines(settings: Settings) -> AsyncIterator[Engines]:
    started: list[EngineRuntime] = []

    async def start(count: int) -> list[EngineRuntime]:
        new = [EngineRuntime(settings, EchoBackend()) for _ in range(count)]
        for engine in new:
            await engine.start()
        started.extend(new)
        await asyncio.gather(*(asyncio.wait_for(engine.registered.wait(), 10) for engine in new))
        return new

    yield start
    for engine in started:
        await engine.stop()


async def fleet(
    replicas: ReplicaSet, engines: Engines, ids: tuple[str, ...] = IDS, count: int = 2
) -> list[EngineRuntime]:
    """Replicas ``ids`` and ``count`` engines, once every replica knows every engine."""
    await replicas.start(*ids)
    started = await engines(count)
    await replicas.wait_for(lambda statuses: all(len(s["engines"]) == count for s in statuses.values()), 10)
    return started


async def signal(nc: NATS, settings: Settings, header: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    return await request_json(nc, f"{settings.subject_prefix}.{header}", payload or {}, timeout=10)


def writers(history: list[tuple[int, Any]], signals: set[str]) -> set[str]:
    return {record.coordinator_id for _, record in history if record.signal in signals}


# ------------------------------------------------------------ one state, every replica


async def test_alternating_pause_and_unpause_are_acked_every_time(
    settings: Settings, replicas: ReplicaSet, engines: Engines, nc: NATS
) -> None:
    fleet_engines = await fleet(replicas, engines)
    for i in range(30):
        header, state = ("pause", "paused") if i % 2 == 0 else ("unpause", "running")
        ack = await signal(nc, settings, header)
        assert ack["type"] == "ack" and ack["state"] == state, (i, ack)
        await replicas.all_report(STATUS_WITHIN_S, state=state)
        assert all(engine.paused == (state == "paused") for engine in fleet_engines)
    # The queue group spread the signals: every replica took some, and all were acked.
    assert writers(await replicas.history(), {"pause", "unpause"}) == set(IDS)


async def test_pause_suspend_resume_unpause_cycles(
    settings: Settings, replicas: ReplicaSet, engines: Engines, nc: NATS
) -> None:
    fleet_engines = await fleet(replicas, engines)
    for _ in range(4):
        for header, state in (
            ("pause", "paused"),
            ("suspend", "suspended"),
            ("resume", "paused"),
            ("unpause", "running"),
        ):
            ack = await signal(nc, settings, header)
            assert ack["type"] == "ack" and ack["state"] == state, ack
            await replicas.all_report(STATUS_WITHIN_S, state=state)
            assert all(engine.paused == (state != "running") for engine in fleet_engines)
    assert len(writers(await replicas.history(), {"pause", "suspend", "resume", "unpause"})) >= 2


async def test_forbidden_signal_is_refused_by_every_replica(
    settings: Settings, replicas: ReplicaSet, engines: Engines, nc: NATS
) -> None:
    await fleet(replicas, engines, count=1)
    assert (await signal(nc, settings, "pause"))["state"] == "paused"
    _, revision = await replicas.record()
    statuses = await replicas.all_report(STATUS_WITHIN_S, state="paused")
    refused_before = {coordinator_id: s["counters"].get("error_409", 0) for coordinator_id, s in statuses.items()}
    for _ in range(200):
        reply = await signal(nc, settings, "resume")
        assert reply["type"] == "error" and reply["error"] == {
            "code": 409,
            "message": "resume is not allowed in state paused",
        }
        statuses = await replicas.statuses()
        if all(s["counters"].get("error_409", 0) > refused_before[i] for i, s in statuses.items()):
            break
    else:
        raise AssertionError(f"some replica never took a signal: {statuses}")
    assert (await replicas.record())[1] == revision  # nothing was written


async def test_submissions_held_by_every_replica_complete_after_unpause(
    settings: Settings, replicas: ReplicaSet, engines: Engines, nc: NATS
) -> None:
    fleet_engines = await fleet(replicas, engines)
    assert (await signal(nc, settings, "pause"))["state"] == "paused"
    await replicas.all_report(STATUS_WITHIN_S, state="paused")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    submitted = 0
    while True:
        for _ in range(6):
            body = {"prompt": f"held {submitted}", "client_request_id": submitted, "sampling_params": {"max_tokens": 3}}
            await nc.publish(f"{settings.subject_prefix}.submit_request", json.dumps(body).encode(), reply=inbox)
            submitted += 1
        expected = submitted

        def all_held(statuses: dict[str, Status], expected: int = expected) -> bool:
            return sum(s["requests_in_flight"] for s in statuses.values()) == expected

        statuses = await replicas.wait_for(all_held, 5)
        if all(s["requests_in_flight"] > 0 for s in statuses.values()) or submitted >= 120:
            break
    assert all(s["requests_in_flight"] > 0 for s in statuses.values()), statuses
    assert sub.pending_msgs == 0 and all(engine.load == 0 for engine in fleet_engines)

    assert (await signal(nc, settings, "unpause"))["state"] == "running"
    finals = [decode_reply((await sub.next_msg(timeout=10)).data) for _ in range(submitted)]
    assert all(final["type"] == "final" for final in finals)
    assert sorted(final["client_request_id"] for final in finals) == list(range(submitted))
    assert {final["request_id"].rpartition("-")[0] for final in finals} == set(IDS)


async def test_epoch_set_through_one_replica_reaches_requests_routed_by_all(
    settings: Settings, replicas: ReplicaSet, engines: Engines, nc: NATS
) -> None:
    await fleet(replicas, engines)
    ack = await signal(nc, settings, "set_generation_epoch", {"epoch": 7})
    assert (ack["state"], ack["epoch"]) == ("running", 7)
    await replicas.all_report(STATUS_WITHIN_S, epoch=7)
    routed_by: set[str] = set()
    for batch in range(20):
        finals = await asyncio.gather(
            *(
                signal(nc, settings, "submit_request", {"prompt": f"e{batch}{i}", "sampling_params": {"max_tokens": 2}})
                for i in range(6)
            )
        )
        assert all(final["epochs"] == [{"epoch": 7, "start": 0, "end": 2}] for final in finals), finals
        routed_by |= {final["request_id"].rpartition("-")[0] for final in finals}
        if routed_by == set(IDS):
            break
    assert routed_by == set(IDS)
    [late] = await engines(1)  # an engine that registers now learns the epoch
    assert late.epoch == 7 and not late.paused


async def test_late_joining_replica_reports_paused(
    settings: Settings, replicas: ReplicaSet, engines: Engines, nc: NATS
) -> None:
    await fleet(replicas, engines, ids=IDS[:2], count=1)
    assert (await signal(nc, settings, "set_generation_epoch", {"epoch": 3}))["epoch"] == 3
    assert (await signal(nc, settings, "pause"))["state"] == "paused"
    await replicas.spawn(IDS[2])
    first = await replicas.ready(IDS[2])  # its first answer: it read the bucket before it served
    assert (first["state"], first["epoch"]) == ("paused", 3)
    assert (await signal(nc, settings, "unpause"))["state"] == "running"
    await replicas.all_report(STATUS_WITHIN_S, state="running", epoch=3)


async def test_sigkilled_replica_then_unpause_through_the_survivors(
    settings: Settings, replicas: ReplicaSet, engines: Engines, nc: NATS
) -> None:
    fleet_engines = await fleet(replicas, engines)
    assert (await signal(nc, settings, "pause"))["state"] == "paused"
    record, _ = await replicas.record()
    taker = record.coordinator_id  # the replica that took the last signal is the one to die
    replicas.kill(taker)
    assert (await replicas.exited(taker))[0] == -9
    await gone_from_nats(replicas, taker)
    survivors = set(IDS) - {taker}
    assert set((await replicas.all_report(STATUS_WITHIN_S, state="paused")).keys()) == survivors

    ack = await signal(nc, settings, "unpause")
    assert ack["type"] == "ack" and ack["state"] == "running", ack
    assert not any(engine.paused for engine in fleet_engines)
    await replicas.all_report(STATUS_WITHIN_S, state="running")
    assert (await signal(nc, settings, "pause"))["state"] == "paused"  # and they go on
    await replicas.all_report(STATUS_WITHIN_S, state="paused")


async def gone_from_nats(replicas: ReplicaSet, coordinator_id: str) -> None:
    """Until the server has dropped a killed replica's subscriptions (its queue-group member too)."""

    async def dropped() -> None:
        while True:
            try:
                await replicas.status(coordinator_id)
            except nats.errors.NoRespondersError:
                return
            except nats.errors.TimeoutError:
                continue  # the server still holds the dead connection's subscriptions
            await asyncio.sleep(0.02)

    await asyncio.wait_for(dropped(), 15)


async def test_concurrent_random_signals_leave_one_state_and_one_valid_path(
    settings: Settings, replicas: ReplicaSet, engines: Engines
) -> None:
    """Two clients send 100 random signals each at once. Afterwards every replica and engine
    shows the bucket's state and epoch, and the acks ordered by revision form one path
    through the transition table: each write follows from the state before it."""
    fleet_engines = await fleet(replicas, engines)
    headers = [Header.PAUSE, Header.UNPAUSE, Header.SUSPEND, Header.RESUME, Header.SET_GENERATION_EPOCH]
    acks: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        connection = await nats.connect(settings.nats_url)
        try:
            for _ in range(100):
                header = rng.choice(headers)
                payload = {"epoch": rng.randint(0, 1000)} if header is Header.SET_GENERATION_EPOCH else {}
                reply = await signal(connection, settings, header, payload)
                (acks if reply["type"] == "ack" else refused).append(reply)
        finally:
            await connection.close()

    await asyncio.gather(client(1), client(2))
    assert all(reply["error"]["code"] == 409 for reply in refused), refused
    record, final_revision = await replicas.record()

    by_revision: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for ack in acks:
        by_revision[ack["revision"]].append(ack)
    assert set(range(2, final_revision + 1)) <= set(by_revision), "every write was acked"
    state = CoordinatorState.RUNNING  # the record at revision 1, written by the first replica
    epoch = None
    for revision in range(2, final_revision + 1):
        after = CoordinatorState(by_revision[revision][0]["state"])
        assert all(ack["state"] == after for ack in by_revision[revision])
        wrote = [ack for ack in by_revision[revision] if wrote_it(state, ack, after)]
        assert wrote, f"no ack at revision {revision} follows from {state}: {by_revision[revision]}"
        assert sum(1 for ack in wrote if ack["signal"] == "set_generation_epoch") <= 1  # an epoch always writes
        repeats = [ack for ack in by_revision[revision] if ack not in wrote]
        assert all(not decide(after, Header(ack["signal"])).changes for ack in repeats)
        epoch = next((ack["epoch"] for ack in wrote if ack["signal"] == "set_generation_epoch"), epoch)
        state = after
    assert (state, epoch) == (record.state, record.epoch)

    statuses = await replicas.all_report(STATUS_WITHIN_S, state=record.state.value, epoch=record.epoch)
    assert set(statuses) == set(IDS)
    for engine in fleet_engines:
        assert (engine.paused, engine.epoch) == (record.state is not CoordinatorState.RUNNING, record.epoch)
        assert engine.control_state.revision == final_revision
    print(f"\n[replicas] 200 signals: {len(acks)} acked, {len(refused)} refused (409), {final_revision - 1} writes")


def wrote_it(before: CoordinatorState, ack: dict[str, Any], after: CoordinatorState) -> bool:
    """Whether ``ack`` can be the signal that moved the record from ``before`` to ``after``."""
    try:
        decision = decide(before, Header(ack["signal"]))
    except WireError:  # a 409 in ``before``: not this one
        return False
    return decision.changes and decision.new_state is after


async def test_shutdown_stops_every_replica(
    settings: Settings, replicas: ReplicaSet, engines: Engines, nc: NATS
) -> None:
    fleet_engines = await fleet(replicas, engines, count=1)
    await replicas.wait_for(lambda statuses: all(len(s["peers"]) == 2 for s in statuses.values()), 5)
    assert (await signal(nc, settings, "connect"))["type"] == "connect_ack"  # shutdown needs a client that connected
    ack = await signal(nc, settings, "shutdown")
    assert ack["type"] == "ack" and ack["signal"] == "shutdown" and ack["replicas"] == 3, ack
    for coordinator_id in IDS:
        assert (await replicas.exited(coordinator_id))[0] == 0
    assert all(engine.registered.is_set() for engine in fleet_engines)  # engines stay
    # A Deployment restarts the pods: a replica started after the shutdown serves on.
    await replicas.start("r3")
    assert (await replicas.status("r3"))["state"] == "running"
    final = await signal(nc, settings, "submit_request", {"prompt": "after", "sampling_params": {"max_tokens": 3}})
    assert final["type"] == "final" and final["request_id"].startswith("r3-")


# ------------------------------------------------------------ without JetStream


@pytest.fixture(scope="module")
def plain_nats() -> Any:
    with EmbeddedNatsServer(jetstream=False) as server:
        yield server


async def test_one_coordinator_without_jetstream_works_and_warns_once(
    plain_nats: EmbeddedNatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(plain_nats.url)
    async with Coordinator(settings, HANDLERS) as coordinator, EngineRuntime(settings, EchoBackend()) as engine:
        await asyncio.wait_for(engine.registered.wait(), 10)
        assert not coordinator.shared.shared
        nc = await nats.connect(plain_nats.url)
        try:
            assert (await signal(nc, settings, "pause"))["state"] == "paused" and engine.paused
            assert (await signal(nc, settings, "unpause"))["state"] == "running" and not engine.paused
            assert (await signal(nc, settings, "submit_request", {"prompt": "ok"}))["type"] == "final"
        finally:
            await nc.close()
    warnings = [record.getMessage() for record in caplog.records if "JetStream" in record.getMessage()]
    assert len(warnings) == 1 and "only replica" in warnings[0], warnings


async def test_second_replica_without_jetstream_refuses_to_start(plain_nats: EmbeddedNatsServer) -> None:
    settings = make_settings(plain_nats.url)
    async with Coordinator(settings, HANDLERS) as first:
        nc = await nats.connect(plain_nats.url)
        second = ReplicaSet(settings, nc)
        try:
            await second.spawn("second")
            status, log = await second.exited("second", timeout_s=30)
        finally:
            await second.close()
            await nc.close()
    assert status == 1
    assert f"coordinator {first.id} already serves prefix {settings.subject_prefix}" in log and "JetStream" in log


async def test_replicas_started_together_without_jetstream_leave_one(plain_nats: EmbeddedNatsServer) -> None:
    """Two replicas that asked at the same moment both found nobody; once they hear each other's
    heartbeats, the one with the higher id stops with an error."""
    settings = make_settings(plain_nats.url, coordinator_id="z-replica")
    async with Coordinator(settings, HANDLERS) as coordinator:
        nc = await nats.connect(plain_nats.url)
        try:
            beat = encode_msgpack(CoordinatorHeartbeat("a-replica"))

            async def beat_until_stopped() -> None:
                while True:
                    await nc.publish(coordinator.subjects.coordinator(Header.COORDINATOR_HEARTBEAT), beat)
                    await asyncio.sleep(settings.heartbeat_interval_s)

            beating = asyncio.create_task(beat_until_stopped())
            await asyncio.wait_for(coordinator.run_until_stopped(), 10)
            beating.cancel()
        finally:
            await nc.close()
    assert coordinator.failure is not None and "a-replica also serves prefix" in coordinator.failure
