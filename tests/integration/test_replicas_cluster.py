"""Coordinator replicas on a three-node NATS cluster (tests/nats_cluster.py: containers on a Docker
network): the control bucket gets three replicas, and the shared control state keeps working
while the node that leads the bucket is stopped under it.

Needs Docker and the NATS image (`make images`); skipped without them outside CI.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from service.coordinator.shared_state import bucket_name
from service.ops.settings import Settings
from tests.conftest import make_settings
from tests.docker_env import images_or_skip
from tests.helpers import request_json
from tests.nats_cluster import Cluster, nats_cluster
from tests.replicas import ReplicaSet

pytestmark = pytest.mark.timeout(180)
IDS = ("r0", "r1")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    client = images_or_skip()
    with nats_cluster(client) as running:
        yield running
    client.close()


@pytest.fixture
async def nc(cluster: Cluster) -> AsyncIterator[NATS]:
    connection = await nats.connect(servers=cluster.urls.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    yield connection
    await connection.close()


FAILOVER_S = 20.0
T = TypeVar("T")


async def through_a_failover(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, made again while NATS answers that nobody listens: replicas whose node was
    stopped are reconnecting to the others, and until they are, their subscriptions are absent
    there. Any other error, or no answer within FAILOVER_S, fails."""
    deadline = asyncio.get_running_loop().time() + FAILOVER_S
    while True:
        try:
            return await call()
        except NoRespondersError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_the_control_bucket_has_three_replicas_and_survives_its_leader_stopped(
    cluster: Cluster, nc: NATS
) -> None:
    # The settings default (5 s), not make_settings' 2 s: a new three-replica bucket elects its leader.
    settings = make_settings(cluster.urls, control_timeout_s=Settings().control_timeout_s)
    replicas = ReplicaSet(settings, nc)
    engine: EngineRuntime | None = None
    try:
        # The first read of the new three-replica bucket waits out its leader election
        # (SharedControlState._first_read): the replicas start once, without a restart.
        for coordinator_id in IDS:
            await replicas.start(coordinator_id, timeout_s=60)
        info = await nc.jetstream(timeout=10).stream_info(f"KV_{bucket_name(settings.subject_prefix)}")
        assert info.config.num_replicas == 3, info.config
        assert info.cluster is not None and info.cluster.leader, info.cluster
        leader = [node.name for node in cluster.nodes].index(info.cluster.leader)
        # The engine keeps to the other nodes: the failover under test is the replicas' and the
        # bucket's (an engine that is itself reconnecting is rightly named in an error reply).
        others = ",".join(cluster.url(index) for index in range(len(cluster.nodes)) if index != leader)
        engine = EngineRuntime(settings.model_copy(update={"nats_url": others}), EchoBackend())
        await engine.start()
        await asyncio.wait_for(engine.registered.wait(), 20)

        pause = await request_json(nc, f"{settings.subject_prefix}.pause", {}, timeout=10)
        assert (pause["type"], pause["state"]) == ("ack", "paused"), pause
        await asyncio.to_thread(cluster.stop, leader)
        # Two of three nodes keep the bucket's quorum: the next signals are acked by the replicas.
        for header, state in (("unpause", "running"), ("pause", "paused"), ("unpause", "running")):
            subject = f"{settings.subject_prefix}.{header}"
            ack = await through_a_failover(functools.partial(request_json, nc, subject, {}, timeout=30))
            assert (ack["type"], ack["state"]) == ("ack", state), (header, ack)
        # A replica whose watch of the key stalls at the failover reads the record again within
        # a heartbeat timeout (SharedControlState.refresh), so every one reports the last state.
        await through_a_failover(functools.partial(replicas.all_report, 10, state="running"))
        moved = await nc.jetstream(timeout=10).stream_info(f"KV_{bucket_name(settings.subject_prefix)}")
        assert moved.cluster is not None and moved.cluster.leader not in (None, info.cluster.leader), moved.cluster
        assert not engine.paused  # the last signal, unpause, reached it
    finally:
        if engine is not None:
            await engine.stop()
        await replicas.close()
