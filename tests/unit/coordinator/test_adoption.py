"""Adoption and ownership on the ledger alone: a dead replica's requests, handed over by their
engines, are held by the adopter as its own; a client's abort reaches the ledger only from
the request's owner."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from service.bus.registry import Incoming
from service.coordinator.admission import Admission
from service.coordinator.adoption import Adoption
from service.coordinator.forwarding import Forwarding
from service.coordinator.ownership import Ownership
from service.coordinator.relay import ReplyRelay
from service.protocol.codec import Encoding, encode_msgpack
from service.protocol.errors import WireError
from service.protocol.routed import AdoptedRequest, EngineAck, RoutedReply
from service.protocol.subjects import ADOPT, Header
from tests.unit.coordinator.conftest import Later
from tests.unit.coordinator.wiring import Floor, build, reply


def adoption(floor: Floor) -> tuple[Adoption, ReplyRelay]:
    relay = ReplyRelay(floor.core, floor.ledger, floor.answers, floor.peers, floor.kept, floor.replies)
    job = Adoption(floor.core, floor.ledger, floor.answers, floor.pool, floor.peers, floor.kept, relay, floor.replies)
    return job, relay


async def test_a_dead_replicas_requests_are_held_by_the_adopter_from_where_their_engine_is(later: Later) -> None:
    floor = build()
    job, relay = adoption(floor)
    engine = floor.engine("e1")
    later.advance(floor.settings.heartbeat_timeout_s)
    theirs = floor.request(coordinator_id="c0", stream=True)
    named_here = msgspec.structs.replace(theirs.return_path, coordinator_id="c1")
    handed = AdoptedRequest(named_here, theirs.body, partials_sent=2, tokens=[4, 5], attempt=0)
    floor.bus.responders[floor.core.subjects.broadcast(ADOPT)] = lambda body: [
        encode_msgpack(EngineAck("e1", ADOPT, adopted=[handed]))
    ]
    floor.kept.keep("e1", reply(theirs, b'{"type":"partial","seq":1}', seq=1), terminal=False)  # before the handover
    job.departed("c0")
    assert job.settling
    await floor.spawned.settle()
    held = floor.ledger.get(theirs.return_path.request_id)
    assert held is not None and held.engine_id == "e1" and held.partials_delivered == 2 and engine.load == 1
    assert held.streamed_tokens == [4, 5] and floor.core.counters["requests_adopted"] == 1 and not job.settling
    [kept] = floor.bus.to(theirs.return_path.reply_to)  # delivered as it was: the request already counts it
    assert kept.json()["seq"] == 1
    await relay.relay_finals("e1", [RoutedReply(named_here, b'{"type":"final"}', seq=2)])
    assert len(floor.ledger) == 0 and engine.load == 0


def abort_from(owner: str) -> Incoming:
    return Incoming(Header.ABORT_REQUEST, f"{owner}.x", Encoding.JSON, b"{}", None, owner)


async def test_an_abort_is_applied_only_for_the_requests_owner() -> None:
    floor = build()
    floor.engine("e1", capacity=1)
    admission = Admission(floor.core, floor.ledger, floor.answers, floor.pool, floor.peers, floor.replies)
    ownership = Ownership(
        floor.core,
        floor.ledger,
        floor.peers,
        admission,
        Forwarding(floor.core, floor.peers, lambda: False),
        floor.replies,
    )
    floor.ledger.admit(floor.request(), None, floor.pool.get("e1"))
    queued = floor.request()
    floor.ledger.admit(queued, None, None)
    request_id = queued.return_path.request_id
    with pytest.raises(WireError) as refusal:
        await ownership.abort(abort_from("_INBOX_bob"), request_id, None)
    assert refusal.value.code == 403 and request_id in floor.ledger
    aborted = await ownership.abort(abort_from("_INBOX"), request_id, None)
    assert aborted == request_id and request_id not in floor.ledger
    [final] = floor.bus.to(queued.return_path.reply_to)
    assert final.json()["finish_reason"] == "abort"
    with pytest.raises(WireError) as unknown:
        await ownership.abort(abort_from("_INBOX"), "c1-none", None)
    assert unknown.value.code == 404


async def test_an_adoption_waits_for_no_engine_that_left_the_pool_meanwhile(later: Later) -> None:
    """An engine that dies with the replica answers no ``adopt``: once the fleet removes it, the
    adoption (and the arbitration waiting on it) ends, not a control timeout later."""
    floor = build(control_timeout_s=600.0)
    job, _ = adoption(floor)
    floor.engine("e1")
    floor.engine("e2")
    later.advance(floor.settings.heartbeat_timeout_s)
    floor.bus.responders[floor.core.subjects.broadcast(ADOPT)] = lambda body: [encode_msgpack(EngineAck("e1", ADOPT))]
    job.departed("c0")
    await asyncio.sleep(0)  # the broadcast is out, e2 silent
    assert job.adopting
    floor.pool.remove("e2", departed=True)  # the fleet found it dead
    await asyncio.wait_for(floor.spawned.settle(), 10)  # far less than control_timeout_s
    assert not job.adopting and floor.core.counters["peers_adopted"] == 1
