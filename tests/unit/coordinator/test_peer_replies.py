"""Replies kept for other replicas' requests: forgotten once their owner has surely dealt with
them, kept while it is silent, bounded by bytes, and taken in arrival order by an adopter."""

from __future__ import annotations

from collections import Counter

from service.bus.batches import item_size
from service.coordinator.peer_replies import PeerReplies
from service.protocol.routed import ReturnPath, RoutedReply
from tests.unit.coordinator.conftest import Clock


def reply(owner: str, request_id: str, seq: int, size: int = 10) -> RoutedReply:
    return RoutedReply(ReturnPath(request_id, owner, "_INBOX.x.1", "msgpack", True, None), b"x" * size, seq)


def test_replies_of_a_live_owner_are_forgotten_once_it_was_heard_after_them(clock: Clock) -> None:
    heard: dict[str, float] = {"c2": clock.now}
    kept = PeerReplies(heard.get, margin_s=2.0, max_bytes=10_000, counters=Counter())
    kept.keep("e1", reply("c2", "c2-a", 0), terminal=False)
    clock.now += 1.0
    heard["c2"] = clock.now
    kept.trim()
    assert kept.peers() == ["c2"]  # heard within the margin: the owner may not have it yet
    clock.now += 2.5
    heard["c2"] = clock.now
    kept.trim()
    assert kept.peers() == [] and kept.bytes == 0


def test_replies_of_a_silent_owner_are_kept_in_order_for_its_adopter(clock: Clock) -> None:
    heard: dict[str, float] = {}
    kept = PeerReplies(heard.get, margin_s=2.0, max_bytes=10_000, counters=Counter())
    for seq in range(3):
        kept.keep("e1", reply("c2", "c2-a", seq), terminal=False)
        clock.now += 10.0
    kept.keep("e1", reply("c2", "c2-a", 3), terminal=True)
    kept.trim()
    taken = kept.take("c2")
    assert [item.reply.seq for item in taken] == [0, 1, 2, 3] and taken[-1].terminal
    assert kept.take("c2") == [] and kept.bytes == 0


def test_kept_replies_are_bounded_by_bytes_oldest_dropped_first(clock: Clock) -> None:
    counters: Counter[str] = Counter()
    one = item_size(b"x" * 100, reply("c2", "c2-a", 0).return_path)
    kept = PeerReplies(lambda peer: None, margin_s=2.0, max_bytes=3 * one + one // 2, counters=counters)
    for seq in range(5):
        kept.keep("e1", reply("c2", "c2-a", seq, size=100), terminal=False)
    assert [item.reply.seq for item in kept.take("c2")] == [2, 3, 4]
    assert counters["peer_replies_dropped"] == 2
