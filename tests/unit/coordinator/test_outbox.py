"""The outbox on the ledger alone: what a loop turn routed leaves as one message per engine;
answered requests are skipped, oversized ones fail with 413, a refused publish with 503."""

from __future__ import annotations

import msgspec

from service.coordinator.outbox import Outbox
from service.coordinator.requests import InflightRequest
from service.protocol.routed import RoutedRequestBatch
from service.protocol.subjects import Header
from tests.unit.coordinator.wiring import Floor, build


def routed(floor: Floor, count: int, **fields: object) -> list[InflightRequest]:
    entries = []
    for _ in range(count):
        entry = floor.request(**fields)  # type: ignore[arg-type]
        floor.ledger.admit(entry, None, floor.ledger.engine_for(floor.pool.everyone, None, None))
        entries.append(entry)
    return entries


def batches(floor: Floor, engine_id: str) -> list[RoutedRequestBatch]:
    subject = floor.core.subjects.engine(engine_id, Header.SUBMIT_REQUEST)
    return [msgspec.msgpack.decode(sent.body, type=RoutedRequestBatch) for sent in floor.bus.on(subject)]


async def test_a_turns_requests_leave_as_one_message_per_engine() -> None:
    floor = build(routing_policy="round_robin")
    floor.engine("e1")
    floor.engine("e2")
    entries = routed(floor, 4)
    await Outbox(floor.core, floor.ledger).route_once()
    for engine_id in ("e1", "e2"):
        [batch] = batches(floor, engine_id)
        assert [item.return_path.request_id for item in batch.requests] == [
            entry.return_path.request_id for entry in entries if entry.engine_id == engine_id
        ]
        assert all(item.attempt == 0 and item.resume_tokens is None for item in batch.requests)
    assert floor.core.counters["routed_messages"] == 2 and floor.core.counters["routed_requests"] == 4


async def test_a_request_answered_before_its_turn_ends_is_not_sent() -> None:
    floor = build()
    floor.engine("e1")
    kept, answered = routed(floor, 2)
    floor.ledger.finish(answered.return_path.request_id)
    await Outbox(floor.core, floor.ledger).route_once()
    [batch] = batches(floor, "e1")
    assert [item.return_path.request_id for item in batch.requests] == [kept.return_path.request_id]


async def test_a_migrated_request_carries_its_run_and_the_tokens_streamed() -> None:
    floor = build()
    floor.engine("e1")
    [entry] = routed(floor, 1, stream=True)
    floor.ledger.take_routed()
    entry.streamed, entry.streamed_tokens = True, [5, 6, 7]
    floor.ledger.requeue(entry, migrated=True)
    floor.ledger.release()
    await Outbox(floor.core, floor.ledger).route_once()
    [batch] = batches(floor, "e1")
    assert batch.requests[0].attempt == 1 and batch.requests[0].resume_tokens == [5, 6, 7]


async def test_a_request_too_large_to_route_fails_with_413() -> None:
    floor = build(max_payload=512)
    outbox = Outbox(floor.core, floor.ledger)
    floor.engine("e1")
    [small] = routed(floor, 1)
    [large] = routed(floor, 1, body=b'{"prompt": "' + b"x" * 1000 + b'"}')
    await outbox.route_once()
    [batch] = batches(floor, "e1")
    assert [item.return_path.request_id for item in batch.requests] == [small.return_path.request_id]
    [answer] = floor.bus.to(large.return_path.reply_to)
    assert answer.json()["error"]["code"] == 413 and large.return_path.request_id not in floor.ledger


async def test_a_refused_publish_fails_its_batch_with_503_and_the_outbox_goes_on() -> None:
    floor = build()
    floor.engine("e1")
    outbox = Outbox(floor.core, floor.ledger)
    entries = routed(floor, 2)
    floor.bus.refusals["dpcoord.engine."] = ConnectionError("connection closed")
    await outbox.route_once()
    del floor.bus.refusals["dpcoord.engine."]
    for entry in entries:
        [answer] = floor.bus.to(entry.return_path.reply_to)
        assert answer.json()["error"]["code"] == 503
    assert len(floor.ledger) == 0 and floor.pool.get("e1").load == 0  # type: ignore[union-attr]
    routed(floor, 1)
    await outbox.route_once()
    assert len(batches(floor, "e1")) == 1


async def test_sent_returns_once_what_was_routed_has_left() -> None:
    floor = build()
    floor.engine("e1")
    outbox = Outbox(floor.core, floor.ledger)
    routed(floor, 1)
    await outbox.route_once()
    await outbox.sent(timeout_s=1.0)
    assert not floor.ledger.routing
