"""Admission on the ledger alone: a submission is accepted into the ledger (routed or queued)
or refused with its code, and a named client's repeat is answered, never run twice."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from service.bus.registry import Incoming
from service.coordinator.admission import Admission
from service.protocol.codec import Encoding, encode_msgpack
from service.protocol.errors import WireError
from service.protocol.messages import SubmitEnvelope, SubmitRequest
from service.protocol.state import CoordinatorState
from service.protocol.subjects import Header
from tests.unit.coordinator.conftest import Later
from tests.unit.coordinator.wiring import Floor, build


def admission(floor: Floor) -> Admission:
    return Admission(floor.core, floor.ledger, floor.answers, floor.pool, floor.peers, floor.replies)


def submission(reply: str | None = "_INBOX.client.1", **fields: Any) -> tuple[Incoming, SubmitRequest]:
    body = msgspec.json.encode({"prompt": "hi", **fields})
    owner = None if reply is None else reply.split(".")[0]
    incoming = Incoming(Header.SUBMIT_REQUEST, reply, Encoding.JSON, body, None, owner)
    return incoming, msgspec.json.decode(body, type=SubmitRequest)


async def refused(job: Admission, reply: str | None = "_INBOX.client.1", **fields: Any) -> int:
    with pytest.raises(WireError) as refusal:
        await job.admit(*submission(reply, **fields))
    return int(refusal.value.code)


async def test_an_accepted_submission_is_routed_through_the_ledger() -> None:
    floor = build()
    floor.engine("e1")
    await admission(floor).admit(*submission())
    [entry] = list(floor.ledger)
    assert entry.engine_id == "e1" and entry.owner == "_INBOX" and entry.return_path.reply_to == "_INBOX.client.1"
    assert entry.return_path.request_id.startswith("c1-") and floor.ledger.take_routed() == {"e1": [entry]}


async def test_a_submission_waits_while_the_fleet_is_not_yet_heard_or_not_running() -> None:
    floor = build()
    job = admission(floor)
    await job.admit(*submission())  # no engine yet, but this replica has not heard the fleet
    floor.engine("e1")
    floor.control.state = CoordinatorState.PAUSED
    await job.admit(*submission("_INBOX.client.2"))
    assert floor.ledger.queued == 2 and all(entry.engine_id is None for entry in floor.ledger)


async def test_refusals_carry_their_codes(later: Later) -> None:
    floor = build(max_queued_requests=1, max_request_timeout_s=60)
    job = admission(floor)
    later.advance(floor.settings.heartbeat_timeout_s)
    assert await refused(job) == 503  # no engine, and the fleet is known
    floor.engine("e1", capacity=1, model="m")
    assert await refused(job, model="other") == 404
    assert await refused(job, reply_to="_INBOX_bob.x") == 400  # not under the sender's own prefix
    assert await refused(job, reply=None, reply_to="_INBOX_bob.x") == 400  # a plain publish: shared prefix only
    assert await refused(job, reply_to="dpcoord.submit_request") == 400  # not an inbox
    assert await refused(job, sampling_params={"timeout_s": 61}) == 400
    await job.admit(*submission(model="m"))  # takes the only slot
    await job.admit(*submission("_INBOX.client.2", model="m"))  # waits
    assert await refused(job, model="m") == 429
    assert len(floor.ledger) == 2


async def test_a_named_clients_repeat_in_flight_is_answered_on_its_reply_subject_and_refused_on_another() -> None:
    """The same reply subject (the client library's resubmission) keeps the request; another one
    gets 409 in progress rather than taking the replies and leaving the first inbox silent."""
    floor = build()
    floor.engine("e1")
    job = admission(floor)
    named: dict[str, Any] = {"client_id": "alice", "client_request_id": "q1", "stream": True}
    await job.admit(*submission(**named))
    await job.admit(*submission(**named))
    [entry] = list(floor.ledger)
    assert entry.return_path.reply_to == "_INBOX.client.1" and entry.return_path.stream
    assert floor.core.counters["resubmitted"] == 1
    with pytest.raises(WireError, match="in progress") as refusal:
        await job.admit(*submission("_INBOX.client.2", **named))
    assert refusal.value.code == 409 and entry.return_path.reply_to == "_INBOX.client.1"
    assert await refused(job, "_INBOX_mallory.x", **named) == 403
    assert await refused(job, "_INBOX.client.3", prompt="other", **named) == 409
    assert len(floor.ledger) == 1


async def test_a_named_clients_repeat_after_its_final_gets_the_cached_final_again() -> None:
    floor = build()
    floor.engine("e1")
    job = admission(floor)
    named = {"client_id": "alice", "client_request_id": "q1"}
    await job.admit(*submission(**named))
    [entry] = list(floor.ledger)
    floor.ledger.finish(entry.return_path.request_id)
    await floor.answers.final(entry, b'{"type":"final","text":"done"}')
    await job.admit(*submission("_INBOX.client.9", **named))
    [again] = floor.bus.to("_INBOX.client.9")
    assert again.json()["text"] == "done" and len(floor.ledger) == 0 and floor.core.counters["replayed"] == 1
    assert job.holds(("alice", "q1"))


async def test_an_anonymous_repeat_in_flight_is_a_conflict() -> None:
    floor = build()
    floor.engine("e1")
    job = admission(floor)
    await job.admit(*submission(client_request_id="q1"))
    assert await refused(job, "_INBOX.client.2", client_request_id="q1") == 409


async def test_a_client_that_reads_reply_batches_gets_them_where_its_batch_subject_may_receive_replies() -> None:
    floor = build()
    floor.engine("e1")
    job = admission(floor)
    body = encode_msgpack(SubmitRequest("hi"))
    for reply_to, reads_batches in (("_INBOX.client.1", True), ("_INBOX.client.b", True), ("_INBOX.client.2", False)):
        incoming = Incoming(Header.SUBMIT_REQUEST, reply_to, Encoding.MSGPACK, b"", None, "_INBOX")
        await job.admit(incoming, SubmitEnvelope(1, body, batched_replies=reads_batches))
    batched = {entry.return_path.reply_to: entry.return_path.batched for entry in floor.ledger}
    # "b" is the batch token itself, so that subject's replies cannot be told from a batch: they go alone.
    assert batched == {"_INBOX.client.1": True, "_INBOX.client.b": False, "_INBOX.client.2": False}
    await job.admit(*submission("_INBOX.client.3"))  # a plain submission (the nats CLI's) reads no batches
    [plain] = [entry for entry in floor.ledger if entry.return_path.reply_to == "_INBOX.client.3"]
    assert not plain.return_path.batched
