"""The reply relay on the ledger alone: engine replies reach their clients in order, a final
finishes its request through the ledger (which routes what waited), and replies of other
runs, other engines and other replicas are sorted out."""

from __future__ import annotations

import msgspec

from service.bus.batches import BATCH_OVERHEAD
from service.coordinator.relay import ReplyRelay
from service.coordinator.requests import InflightRequest
from service.protocol.reply_batches import batch_decoder
from service.protocol.routed import RoutedReply
from tests.unit.coordinator.conftest import Later
from tests.unit.coordinator.wiring import Floor, build, reply


def relay(floor: Floor) -> ReplyRelay:
    return ReplyRelay(floor.core, floor.ledger, floor.answers, floor.peers, floor.kept, floor.replies)


def admitted(floor: Floor, **fields: object) -> InflightRequest:
    entry = floor.request(**fields)  # type: ignore[arg-type]
    floor.ledger.admit(entry, None, floor.ledger.engine_for(floor.pool.everyone, None, None))
    return entry


async def test_a_final_reaches_the_client_and_its_slot_goes_to_the_next_waiting_request() -> None:
    floor = build()
    engine = floor.engine("e1", capacity=1)
    job = relay(floor)
    first = admitted(floor, client=("alice", "q1"))
    waiting = admitted(floor)
    await job.relay_finals("e1", [reply(first, b'{"type":"final","n":1}')])
    [final] = floor.bus.to(first.return_path.reply_to)
    assert final.json()["n"] == 1 and first.return_path.request_id not in floor.ledger
    assert waiting.engine_id == "e1" and engine.requests == {waiting.return_path.request_id}
    assert floor.answers.cached(("alice", "q1")) is not None and floor.core.counters["completed"] == 1


async def test_a_final_that_overtook_a_partial_waits_for_it() -> None:
    floor = build()
    floor.engine("e1")
    job = relay(floor)
    entry = admitted(floor, stream=True)
    await job.relay_finals("e1", [reply(entry, b'{"type":"final"}', seq=1)])
    assert floor.bus.to(entry.return_path.reply_to) == [] and entry.return_path.request_id in floor.ledger
    await job.relay_partials("e1", [reply(entry, b'{"type":"partial"}', seq=0, tokens=[7])])
    partial, final, end = floor.bus.to(entry.return_path.reply_to)
    assert partial.json()["type"] == "partial" and final.json()["type"] == "final" and end.body == b""
    assert len(floor.ledger) == 0


async def test_a_streams_tokens_are_kept_while_no_partial_is_missing() -> None:
    floor = build()
    floor.engine("e1")
    job = relay(floor)
    entry = admitted(floor, stream=True)
    await job.relay_partials("e1", [reply(entry, b"{}", seq=0, tokens=[1, 2]), reply(entry, b"{}", seq=1, tokens=[3])])
    assert entry.streamed and entry.streamed_tokens == [1, 2, 3] and entry.resumable
    await job.relay_partials("e1", [reply(entry, b"{}", seq=3, tokens=[5])])  # seq 2 never came
    assert not entry.resumable and entry.streamed_tokens is None
    assert floor.core.counters["streams_not_resumable"] == 1


async def test_replies_from_another_engine_or_an_older_run_are_dropped() -> None:
    floor = build()
    floor.engine("e1")
    job = relay(floor)
    entry = admitted(floor)
    await job.relay_finals("e2", [reply(entry)])
    assert floor.core.counters["stale_engine_replies"] == 1
    floor.ledger.requeue(entry)
    floor.ledger.release()  # the second run, on the same engine
    await job.relay_finals("e1", [reply(entry, attempt=0)])
    assert floor.core.counters["stale_attempt_replies"] == 1
    assert floor.bus.to(entry.return_path.reply_to) == [] and entry.return_path.request_id in floor.ledger
    await job.relay_finals("e1", [reply(entry, attempt=1)])
    assert len(floor.bus.to(entry.return_path.reply_to)) == 1


async def test_an_own_reply_after_the_request_ended_is_counted_not_sent() -> None:
    floor = build()
    floor.engine("e1")
    job = relay(floor)
    entry = admitted(floor)
    floor.ledger.finish(entry.return_path.request_id)
    await job.relay_finals("e1", [reply(entry)])
    assert floor.core.counters["late_replies"] == 1 and floor.bus.to(entry.return_path.reply_to) == []


async def test_a_live_peers_replies_are_kept_and_a_dead_ones_delivered_by_its_adopter(later: Later) -> None:
    floor = build()
    job = relay(floor)
    later.advance(floor.settings.heartbeat_timeout_s)  # this replica has heard the fleet
    floor.peers.saw("c2")
    theirs = floor.request(coordinator_id="c2")
    await job.relay_finals("e1", [reply(theirs)])
    assert floor.bus.to(theirs.return_path.reply_to) == [] and len(floor.kept.take("c2")) == 1
    later.advance(floor.settings.heartbeat_timeout_s)  # c2 fell silent: dead, and c1 the lowest live id
    dead = floor.request(coordinator_id="c0")
    await job.relay_finals("e1", [reply(dead)])
    [delivered] = floor.bus.to(dead.return_path.reply_to)
    assert delivered.body == reply(dead).body and floor.core.counters["orphans_delivered"] == 1


async def test_an_orphan_is_delivered_to_an_inbox_only(later: Later) -> None:
    floor = build()
    job = relay(floor)
    later.advance(floor.settings.heartbeat_timeout_s)
    orphan = floor.request(coordinator_id="c0")
    rewritten = msgspec.structs.replace(orphan.return_path, reply_to="dpcoord.submit_request")  # not an inbox
    await job.relay_finals("e1", [RoutedReply(rewritten, b'{"type":"final"}')])
    assert floor.bus.published == [] and floor.core.counters["unsafe_reply_subject"] == 1


async def test_one_engine_message_reaches_a_client_that_reads_batches_as_one_batch_in_order() -> None:
    floor = build()
    floor.engine("e1")
    job = relay(floor)
    first, second = admitted(floor, stream=True, batched=True), admitted(floor, stream=True, batched=True)
    alone = admitted(floor, stream=True)  # its client reads no batches
    await job.relay_partials(
        "e1",
        [
            reply(first, b"1a", seq=0),
            reply(alone, b"3a", seq=0),
            reply(second, b"2a", seq=0),
            reply(first, b"1b", seq=1),
        ],
    )
    [batch] = floor.bus.on("_INBOX.client.b")
    token = first.return_path.reply_to.rpartition(".")[2].encode()
    other = second.return_path.reply_to.rpartition(".")[2].encode()
    assert batch_decoder.decode(batch.body) == [(token, b"1a"), (other, b"2a"), (token, b"1b")]
    assert [message.body for message in floor.bus.on(alone.return_path.reply_to)] == [b"3a"]
    await job.relay_finals("e1", [reply(first, b"1f", seq=2), reply(second, b"2f", seq=1)])
    assert batch_decoder.decode(floor.bus.on("_INBOX.client.b")[1].body) == [
        (token, b"1f"),
        (token, b""),
        (other, b"2f"),
        (other, b""),
    ]
    lone = admitted(floor, batched=True)
    await job.relay_finals("e1", [reply(lone, b"4f")])  # a lone reply goes to its own subject
    assert [message.body for message in floor.bus.on(lone.return_path.reply_to)] == [b"4f"]
    assert len(floor.bus.on("_INBOX.client.b")) == 2


async def test_reply_batches_stay_under_max_payload() -> None:
    floor = build(max_payload=2048)
    floor.engine("e1", capacity=8)
    job = relay(floor)
    entries = [admitted(floor, stream=True, batched=True) for _ in range(6)]
    await job.relay_partials("e1", [reply(entry, bytes(500), seq=0) for entry in entries])
    batches = floor.bus.on("_INBOX.client.b")
    assert len(batches) == 2 and all(len(batch.body) <= 2048 - BATCH_OVERHEAD for batch in batches)
    pairs = [pair for batch in batches for pair in batch_decoder.decode(batch.body)]
    assert [token for token, _ in pairs] == [
        entry.return_path.reply_to.rpartition(".")[2].encode() for entry in entries
    ]
