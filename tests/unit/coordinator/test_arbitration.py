"""Arbitration on the ledger alone (service/coordinator/arbitration.py, arbiters.py): a named
submission runs on the replica arbitrating its id, is handed there otherwise (batched per loop
turn), waits while the replicas settle, and an id another replica claims is asked of it first;
claims go to each peer when the view changes. Peers are answered by the RecordingBus."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from service.bus.registry import Incoming
from service.coordinator.admission import Admission
from service.coordinator.arbiters import Arbiters
from service.coordinator.arbitration import Arbitration
from service.coordinator.forwarding import Forwarding
from service.coordinator.ownership import Ownership
from service.protocol.arbiter import ArbiterTable
from service.protocol.codec import Encoding, encode_msgpack
from service.protocol.errors import WireError
from service.protocol.handover import ArbiterClaims, ForwardedSubmission, HandedSubmissions, Holding
from service.protocol.messages import SubmitEnvelope, SubmitRequest
from service.protocol.subjects import Header
from tests.unit.coordinator.wiring import COORDINATOR_ID, Floor, build

PEER = "c2"


class Job:
    """Arbitration wired as coordinator.py wires it, with what it refused kept."""

    def __init__(self, floor: Floor, quiet_s: float = 0.0, joined: bool = True) -> None:
        self.floor = floor
        self.arbiters = Arbiters(COORDINATOR_ID, quiet_s, 1000)
        self.refused: list[WireError] = []
        self.adopting = False
        admission = Admission(floor.core, floor.ledger, floor.answers, floor.pool, floor.peers, floor.replies)
        ownership = Ownership(
            floor.core,
            floor.ledger,
            floor.peers,
            admission,
            Forwarding(floor.core, floor.peers, lambda: False),
            floor.replies,
        )
        self.arbitration = Arbitration(
            floor.core,
            floor.ledger,
            floor.results,
            floor.peers,
            self.arbiters,
            admission,
            ownership,
            adopting=lambda: self.adopting,
            refuse=self._refuse,
        )
        if joined:
            self.arbiters.join()  # it arbitrates once its quiet time passed
        self.arbiters.refresh(self.adopting)  # settled then

    async def _refuse(self, incoming: Incoming, err: WireError) -> None:
        self.refused.append(err)

    async def with_peer(self) -> None:
        """``PEER`` heard (arbitrating) and its claims for the view of both taken: settled."""
        self.floor.peers.saw(PEER)
        self.arbitration.heard(PEER, arbitrates=True)
        await self.floor.spawned.settle()
        await self.arbitration.take_claims(ArbiterClaims(PEER, sorted([COORDINATOR_ID, PEER]), []))
        self.arbiters.refresh(self.adopting)


def named(client_request_id: str, reply: str = "_INBOX.client.1", prompt: str = "hi") -> tuple[Incoming, SubmitRequest]:
    body = msgspec.json.encode({"prompt": prompt, "client_id": "alice", "client_request_id": client_request_id})
    return Incoming(Header.SUBMIT_REQUEST, reply, Encoding.JSON, body, None, "_INBOX"), msgspec.json.decode(
        body, type=SubmitRequest
    )


def ids_of(arbiter: str, count: int) -> list[str]:
    """``count`` ids that ``arbiter`` arbitrates among this replica and ``PEER``."""
    table = ArbiterTable({COORDINATOR_ID, PEER})
    return [crid for crid in (f"q{n}" for n in range(1000)) if table.of("alice", crid) == arbiter][:count]


def resubmitted(client_request_id: str) -> tuple[Incoming, SubmitEnvelope]:
    """The client library's resubmission of a named submission (after a lost replica, say)."""
    envelope = SubmitEnvelope(1, b'{"prompt": "hi"}', False, client_request_id, "alice", resubmission=True)
    body = encode_msgpack(envelope)
    return Incoming(Header.SUBMIT_REQUEST, "_INBOX.client.1", Encoding.MSGPACK, body, None, "_INBOX"), envelope


async def test_alone_a_replica_runs_new_submissions_at_once_and_resubmissions_after_its_quiet_time() -> None:
    """A replica just restarted gets its clients' resubmissions at once, and a peer it has not
    heard yet may hold them: it holds those until its quiet time passed."""
    floor = build()
    floor.engine("e1")
    job = Job(floor, quiet_s=60.0)
    await job.arbitration.admit(*named("q1"))
    await job.arbitration.admit(*resubmitted("q2"))
    assert [entry.client_key for entry in floor.ledger] == [("alice", "q1")]
    assert floor.core.counters["arbitration_held"] == 1
    settled = Job(build(), quiet_s=0.0)
    settled.floor.engine("e1")
    await settled.arbitration.admit(*resubmitted("q2"))
    assert [entry.client_key for entry in settled.floor.ledger] == [("alice", "q2")]


async def test_an_id_another_replica_arbitrates_is_handed_there_in_one_message_per_turn() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor)
    await job.with_peer()
    theirs = ids_of(PEER, 3)
    for crid in theirs:
        await job.arbitration.admit(*named(crid, reply=f"_INBOX.client.{crid}"))
    [mine] = ids_of(COORDINATOR_ID, 1)
    await job.arbitration.admit(*named(mine))
    await asyncio.sleep(0)  # the turn ends
    await floor.spawned.settle()
    [handed] = floor.bus.on(floor.core.subjects.addressed_to(Header.ARBITER_SUBMISSION, PEER))
    copies = handed.decode(HandedSubmissions).items
    assert [reply for reply, _ in copies] == [f"_INBOX.client.{crid}" for crid in theirs]
    assert [msgspec.json.decode(body)["client_request_id"] for _, body in copies] == theirs
    assert [entry.client_key for entry in floor.ledger] == [("alice", mine)]
    assert floor.core.counters["submissions_handed"] == 3


async def test_a_handed_copy_is_never_handed_on_but_held_until_the_views_agree() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor)
    await job.with_peer()
    [theirs] = ids_of(PEER, 1)
    await job.arbitration.admit(*named(theirs), handed=True)  # the sender's view named this replica
    assert len(floor.ledger) == 0 and floor.core.counters["arbitration_held"] == 1
    assert not floor.bus.on(floor.core.subjects.addressed_to(Header.ARBITER_SUBMISSION, PEER))


async def test_unsettled_an_arbiter_holds_what_it_would_run_and_runs_it_once_settled() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor)
    floor.peers.saw(PEER)
    job.arbitration.heard(PEER, arbitrates=True)
    await floor.spawned.settle()  # the view has both; the peer's claims are not in yet
    assert not job.arbiters.settled and job.arbiters.missing() == [f"claims of {PEER}"]
    [mine] = ids_of(COORDINATOR_ID, 1)
    await job.arbitration.admit(*named(mine))
    assert len(floor.ledger) == 0
    await job.arbitration.take_claims(ArbiterClaims(PEER, sorted([COORDINATOR_ID, PEER]), []))
    assert job.arbiters.settled and [entry.client_key for entry in floor.ledger] == [("alice", mine)]


async def test_an_id_a_peer_claims_is_asked_of_it_first_and_its_answer_is_the_clients() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor)
    await job.with_peer()
    held, gone = ids_of(COORDINATOR_ID, 2)
    claims = ArbiterClaims(PEER, sorted([COORDINATOR_ID, PEER]), [("alice", held), ("alice", gone)])
    await job.arbitration.take_claims(claims)
    asked: list[ForwardedSubmission] = []

    def holder(body: bytes) -> list[bytes]:
        question = msgspec.msgpack.decode(body, type=ForwardedSubmission)
        asked.append(question)
        return [encode_msgpack(Holding(question.client_request_id == held))]

    floor.bus.responders[floor.core.subjects.addressed_to(Header.FORWARD_SUBMISSION, PEER)] = holder
    await job.arbitration.admit(*named(held))
    await job.arbitration.admit(*named(gone))
    await floor.spawned.settle()
    assert [question.client_request_id for question in asked] == [held, gone]
    assert [entry.client_key for entry in floor.ledger] == [("alice", gone)]  # the holder answers the other
    await job.arbitration.admit(*named(held, reply="_INBOX.client.2"))  # asked again while the holder holds it
    await job.arbitration.admit(*named(gone))  # held here now: answered here
    await floor.spawned.settle()
    assert [question.client_request_id for question in asked] == [held, gone, held] and len(floor.ledger) == 1


async def test_claims_go_to_each_peer_with_the_ids_it_arbitrates() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor)
    [theirs] = ids_of(PEER, 1)
    [mine] = ids_of(COORDINATOR_ID, 1)
    for crid in (theirs, mine):
        await job.arbitration.admit(*named(crid))  # alone: both run here
    floor.peers.saw(PEER)
    job.arbitration.heard(PEER, arbitrates=True)
    await floor.spawned.settle()
    [sent] = floor.bus.on(floor.core.subjects.addressed_to(Header.ARBITER_CLAIMS, PEER))
    claims = sent.decode(ArbiterClaims)
    assert claims.holder == COORDINATOR_ID and claims.view == sorted([COORDINATOR_ID, PEER]) and claims.last
    assert claims.keys == [("alice", theirs)]


async def test_a_claim_of_an_id_an_engine_runs_here_means_it_was_adopted_away() -> None:
    """This replica stalled, was taken for dead, and the peer adopted its request: the peer
    answers it, so it leaves this ledger without a reply (it would otherwise run again)."""
    floor = build()
    engine = floor.engine("e1")
    job = Job(floor)
    await job.arbitration.admit(*named("q1"))
    assert engine.load == 1
    await job.arbitration.take_claims(ArbiterClaims(PEER, sorted([COORDINATOR_ID, PEER]), [("alice", "q1")]))
    assert len(floor.ledger) == 0 and engine.load == 0 and not floor.bus.to("_INBOX.client.1")
    assert floor.core.counters["requests_adopted_away"] == 1


async def test_a_departed_peers_claims_go_and_its_adopters_are_awaited() -> None:
    arbiters = Arbiters(COORDINATOR_ID, 0.0, 1000)
    assert arbiters.join()
    for peer in ("c0", PEER):
        arbiters.heard(peer, arbitrates=True)
    arbiters.set_view(["c0", PEER])
    view = sorted([COORDINATOR_ID, "c0", PEER])
    arbiters.take_claims("c0", view, [("alice", "x")], 0, True)
    arbiters.take_claims(PEER, view, [], 0, True)
    assert arbiters.refresh(False) and arbiters.holder(("alice", "x")) == "c0"
    arbiters.departed(PEER, adopter="c0")
    arbiters.set_view(["c0"])
    assert not arbiters.refresh(False) and "the adopter c0" in arbiters.missing()
    arbiters.take_claims("c0", sorted([COORDINATOR_ID, "c0"]), [("alice", "y")], 0, True)
    assert arbiters.refresh(False) and arbiters.holder(("alice", "x")) is None
    assert not arbiters.refresh(adopting=True)


@pytest.mark.parametrize("parts", [1, 3])
async def test_claims_in_parts_count_once_the_last_arrives(parts: int) -> None:
    arbiters = Arbiters(COORDINATOR_ID, 0.0, 1000)
    assert arbiters.join()
    arbiters.heard(PEER, arbitrates=True)
    arbiters.set_view([PEER])
    view = sorted([COORDINATOR_ID, PEER])
    keys: list[Any] = [("alice", f"k{n}") for n in range(parts)]
    for part, key in enumerate(keys):
        assert not arbiters.refresh(False)
        arbiters.take_claims(PEER, view, [key], part, part == parts - 1)
    assert arbiters.refresh(False) and all(arbiters.holder(key) == PEER for key in keys)


async def test_a_replica_that_stops_hands_what_it_held_to_the_arbiters_left() -> None:
    floor = build()
    floor.engine("e1")
    job = Job(floor)
    floor.peers.saw(PEER)
    job.arbitration.heard(PEER, arbitrates=True)
    await floor.spawned.settle()  # unsettled: the peer's claims are not in
    [mine] = ids_of(COORDINATOR_ID, 1)
    await job.arbitration.admit(*named(mine))
    await job.arbitration.stop_arbitrating()
    await asyncio.sleep(0)
    await floor.spawned.settle()
    [handed] = floor.bus.on(floor.core.subjects.addressed_to(Header.ARBITER_SUBMISSION, PEER))
    assert [msgspec.json.decode(body)["client_request_id"] for _, body in handed.decode(HandedSubmissions).items] == [
        mine
    ]
    claims = floor.bus.on(floor.core.subjects.addressed_to(Header.ARBITER_CLAIMS, PEER))[-1]
    assert claims.decode(ArbiterClaims).view == [PEER] and not job.arbitration.arbitrating
