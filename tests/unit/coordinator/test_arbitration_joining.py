"""A replica joins the arbitration (service/coordinator/arbiters.py): for its quiet time it
arbitrates nothing and hands what it gets to the arbitrating peers, so a replica that starts
holds no id up; replicas that start together hold until they arbitrate; a peer that stops
arbitrating leaves the view at once, not a heartbeat later; among peers, a joining replica is
not ready (`/readyz`) until it arbitrates."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

from service.coordinator.arbiters import Arbiters
from service.coordinator.coordinator import Coordinator
from service.coordinator.observability import coordinator_readiness
from service.protocol.handover import HandedSubmissions
from service.protocol.subjects import Header
from tests.unit.coordinator.test_arbitration import PEER, Job, ids_of, named
from tests.unit.coordinator.wiring import COORDINATOR_ID, build


async def test_a_joining_replica_hands_every_named_submission_to_the_arbitrating_peers() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor, quiet_s=60.0)
    floor.peers.saw(PEER)
    job.arbitration.heard(PEER, arbitrates=True)
    await floor.spawned.settle()
    assert job.arbiters.joining and not job.arbitration.arbitrating and job.arbiters.view == {PEER}
    crids = [*ids_of(COORDINATOR_ID, 2), *ids_of(PEER, 2)]  # what it would arbitrate once joined, too
    for crid in crids:
        await job.arbitration.admit(*named(crid, reply=f"_INBOX.client.{crid}"))
    await asyncio.sleep(0)  # the turn ends: its copies go
    await floor.spawned.settle()
    [handed] = floor.bus.on(floor.core.subjects.addressed_to(Header.ARBITER_SUBMISSION, PEER))
    assert [reply for reply, _ in handed.decode(HandedSubmissions).items] == [f"_INBOX.client.{c}" for c in crids]
    assert len(floor.ledger) == 0 and floor.core.counters["arbitration_held"] == 0


async def test_replicas_starting_together_hold_what_they_get_until_they_arbitrate() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor, quiet_s=0.0, joined=False)
    floor.peers.saw(PEER)
    job.arbitration.heard(PEER, arbitrates=False)  # it joins too
    await job.arbitration.beat()
    await job.arbitration.admit(*named("q1"))
    assert len(floor.ledger) == 0 and floor.core.counters["arbitration_held"] == 1
    assert job.arbitration.join()
    await job.arbitration.beat()  # alone among arbiters: what it held runs
    assert [entry.client_key for entry in floor.ledger] == [("alice", "q1")]


async def test_a_peer_that_stops_arbitrating_leaves_the_view_at_once() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor)
    await job.with_peer()
    assert job.arbiters.settled and job.arbiters.view == {COORDINATOR_ID, PEER}
    job.arbitration.heard(PEER, arbitrates=False)  # its heartbeat as it stops
    await floor.spawned.settle()
    assert job.arbiters.view == {COORDINATOR_ID} and job.arbiters.alone and job.arbiters.settled


class ReadinessDouble:
    """A test double of the Coordinator, with what its readiness reads: NATS up, an engine, and
    the arbitration's state."""

    def __init__(self, arbiters: Arbiters) -> None:
        self.nc = SimpleNamespace(is_connected=True)
        self.id = COORDINATOR_ID
        self.engines = [object()]
        self.state = "running"
        self.arbiters = arbiters


def test_among_peers_a_joining_replica_is_not_ready_until_it_arbitrates() -> None:
    arbiters = Arbiters(COORDINATOR_ID, 0.0, 1000)
    double = cast(Coordinator, ReadinessDouble(arbiters))
    assert coordinator_readiness(double).ok  # alone: it serves at once
    arbiters.heard(PEER, arbitrates=True)
    arbiters.set_view([PEER])
    check = coordinator_readiness(double)
    assert not check.ok and "joining" in check.detail
    arbiters.join()
    arbiters.set_view([PEER])
    assert coordinator_readiness(double).ok
