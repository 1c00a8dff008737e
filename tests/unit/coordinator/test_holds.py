"""Holds (service/coordinator/holds.py), on the first floor and a RecordingBus: a client's hold
goes to the engine of a request held here, only from its owner; one held by a peer is forwarded
to the replica its id names; an engine whose every request is held is not suspected."""

from __future__ import annotations

import time

import msgspec
import pytest

from service.bus.registry import Incoming
from service.coordinator.fleet import Fleet
from service.coordinator.holds import Holds
from service.protocol.codec import Encoding, encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.handover import ForwardedHold
from service.protocol.membership import Heartbeat
from service.protocol.messages import Ack, ErrorBody, ErrorReply, HoldRequest
from service.protocol.routed import RoutedHold
from service.protocol.subjects import Header
from tests.unit.coordinator.wiring import Floor, build


def hold_from(owner: str) -> Incoming:
    return Incoming(Header.HOLD_REQUEST, f"{owner}.me.f", Encoding.MSGPACK, b"", None, owner)


def routed(floor: Floor, owner_inbox: str = "_INBOX") -> str:
    floor.engine("e1")
    entry = floor.request(owner_inbox, stream=True)
    floor.ledger.admit(entry, None, floor.ledger.engine_for(floor.pool.group(None), None, None))
    return entry.return_path.request_id


async def test_a_hold_and_its_release_go_to_the_requests_engine_with_their_seq() -> None:
    floor = build()
    holds = Holds(floor.core, floor.ledger, floor.peers)
    request_id = routed(floor)
    assert await holds.hold(hold_from("_INBOX"), HoldRequest(request_id, True, 1)) == request_id
    assert await holds.hold(hold_from("_INBOX"), HoldRequest(request_id, False, 2)) == request_id
    sent = [
        message.decode(RoutedHold)
        for message in floor.bus.on(f"{floor.settings.subject_prefix}.engine.e1.hold_request")
    ]
    assert sent == [RoutedHold(request_id, True, 1), RoutedHold(request_id, False, 2)]
    assert floor.core.counters["holds"] == floor.core.counters["releases"] == 1


async def test_only_the_owner_may_hold_and_an_unknown_request_is_404() -> None:
    floor = build(reply_inbox_prefixes="_INBOX,_OTHER")
    holds = Holds(floor.core, floor.ledger, floor.peers)
    request_id = routed(floor)
    with pytest.raises(WireError) as forbidden:
        await holds.hold(hold_from("_OTHER"), HoldRequest(request_id, True, 1))
    assert forbidden.value.code == ErrorCode.FORBIDDEN
    with pytest.raises(WireError) as unknown:
        await holds.hold(hold_from("_INBOX"), HoldRequest("c1-nope", True, 1))
    assert unknown.value.code == ErrorCode.NOT_FOUND
    assert not floor.bus.to(f"{floor.settings.subject_prefix}.engine.")


async def test_a_hold_for_a_peers_request_is_forwarded_to_the_peer_its_id_names() -> None:
    floor = build()
    holds = Holds(floor.core, floor.ledger, floor.peers)
    floor.peers.saw("c2")
    floor.peers.saw("c3")
    prefix = floor.settings.subject_prefix
    forwarded: list[ForwardedHold] = []

    def c2(body: bytes) -> list[bytes]:
        forwarded.append(msgspec.msgpack.decode(body, type=ForwardedHold))
        return [encode_msgpack(Ack(Header.HOLD_REQUEST, request_id="c2-r9"))]

    floor.bus.responders[f"{prefix}.forward_hold.c2"] = c2
    floor.bus.responders[f"{prefix}.forward_hold.c3"] = lambda body: [
        encode_msgpack(ErrorReply(ErrorBody(ErrorCode.NOT_FOUND, "not here")))
    ]
    assert await holds.hold(hold_from("_INBOX"), HoldRequest("c2-r9", True, 4)) == "c2-r9"
    assert forwarded == [ForwardedHold("_INBOX", "c2-r9", True, 4)]
    assert not floor.bus.on(f"{prefix}.forward_hold.c3")  # the id names c2: only c2 is asked
    assert floor.core.counters["holds_forwarded"] == 1

    floor.bus.responders[f"{prefix}.forward_hold.c2"] = lambda body: [
        encode_msgpack(ErrorReply(ErrorBody(ErrorCode.FORBIDDEN, "another owner's")))
    ]
    with pytest.raises(WireError) as forbidden:
        await holds.hold(hold_from("_INBOX"), HoldRequest("c2-r9", True, 5))
    assert forbidden.value.code == ErrorCode.FORBIDDEN


async def test_a_forwarded_hold_is_applied_only_where_the_request_is_held() -> None:
    floor = build()
    holds = Holds(floor.core, floor.ledger, floor.peers)
    request_id = routed(floor)
    assert await holds.hold_held(ForwardedHold("_INBOX", request_id, True, 1)) == request_id
    with pytest.raises(WireError) as unknown:
        await holds.hold_held(ForwardedHold("_INBOX", "c1-nope", True, 1))
    assert unknown.value.code == ErrorCode.NOT_FOUND


async def test_an_engine_whose_every_request_is_held_makes_progress_by_its_heartbeats() -> None:
    floor = build(engine_progress_timeout_s=1.0)
    fleet = Fleet(floor.core, floor.ledger, floor.pool, floor.control)
    request_id = routed(floor)
    record = floor.pool.get("e1")
    assert record is not None
    record.last_progress = time.monotonic() - 60  # no step for a minute
    await fleet.heartbeat(Heartbeat("e1", 1, 4, [request_id], steps=7, held=[request_id]))
    assert time.monotonic() - record.last_progress < 1  # its one request is held: progress
    record.last_progress = time.monotonic() - 60
    await fleet.heartbeat(Heartbeat("e1", 1, 4, [request_id], steps=7, held=[]))
    assert time.monotonic() - record.last_progress > 59  # nothing held, no step: none
