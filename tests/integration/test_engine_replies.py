"""What an engine remembers of its terminal replies, to send them again after a loss (a NATS
restart, say): bounded by bytes as well as count, the oldest forgotten first. On a real server."""

from __future__ import annotations

from collections import Counter

from engines.replies import ReplyPublisher, reply_size
from service.bus.direct import DirectClient
from service.protocol.routed import ReturnPath, RoutedReply
from service.protocol.subjects import Header, Subjects


def final(number: int) -> RoutedReply:
    return RoutedReply(ReturnPath(f"r-{number}", "c1", "_INBOX.x", "json", False, None), b"x" * 1000)


async def test_recent_replies_are_bounded_by_bytes_oldest_forgotten_first(nats_url: str) -> None:
    client = DirectClient()
    await client.connect(nats_url)
    try:
        publisher = ReplyPublisher("e0", client, Subjects("t"), Counter(), recent_bytes=3 * reply_size(final(0)))
        await publisher.publish(Header.ENGINE_REPLY, [final(number) for number in range(5)])
        assert [publisher.recent(f"r-{number}") is not None for number in range(5)] == [False, False, True, True, True]
        await publisher.publish(Header.ENGINE_REPLY, [final(1)])  # sent again: it is the youngest now
        assert [publisher.recent(f"r-{number}") is not None for number in range(5)] == [False, True, False, True, True]
    finally:
        await client.close()
