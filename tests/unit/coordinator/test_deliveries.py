"""Client deliveries held across a NATS reconnect, on a real server."""

from __future__ import annotations

import asyncio
from collections import Counter

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from service.bus.connection import flush_subscriptions
from service.coordinator.deliveries import HELD_OVERHEAD, ClientDeliveries


async def collect(nc: NATS, subject: str) -> asyncio.Queue[bytes]:
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        await received.put(msg.data)

    await nc.subscribe(subject, cb=on_msg)
    await flush_subscriptions(nc)
    return received


async def test_open_deliveries_publish_at_once(nc: NATS) -> None:
    received = await collect(nc, "_INBOX.open")
    await ClientDeliveries(nc).publish("_INBOX.open", b"one", None)
    assert await asyncio.wait_for(received.get(), 5) == b"one"


async def test_held_deliveries_leave_in_order_on_release(nc: NATS) -> None:
    received = await collect(nc, "_INBOX.held")
    deliveries = ClientDeliveries(nc)
    deliveries.hold()
    for body in (b"1", b"2", b"3"):
        await deliveries.publish("_INBOX.held", body, None)
    await nc.flush()
    assert received.empty()
    await deliveries.release()
    assert [await asyncio.wait_for(received.get(), 5) for _ in range(3)] == [b"1", b"2", b"3"]
    await deliveries.publish("_INBOX.held", b"4", None)
    assert await asyncio.wait_for(received.get(), 5) == b"4"


async def test_a_resubmitting_client_gets_its_held_replies_on_the_new_subject(nc: NATS) -> None:
    old, new = await collect(nc, "_INBOX.old"), await collect(nc, "_INBOX.new")
    deliveries = ClientDeliveries(nc)
    deliveries.hold()
    await deliveries.publish("_INBOX.old", b"final", ("alice", 1))
    await deliveries.publish("_INBOX.old", b"other", ("bob", 2))
    assert deliveries.repoint(("alice", 1), "_INBOX.new")
    assert not deliveries.repoint(("carol", 3), "_INBOX.new")
    await deliveries.release()
    assert await asyncio.wait_for(new.get(), 5) == b"final"
    assert await asyncio.wait_for(old.get(), 5) == b"other"
    assert old.empty()


async def test_held_replies_are_bounded_by_bytes_oldest_dropped_first(nc: NATS) -> None:
    received = await collect(nc, "_INBOX.bounded")
    counters: Counter[str] = Counter()
    deliveries = ClientDeliveries(nc, counters, max_bytes=3 * (100 + len("_INBOX.bounded") + HELD_OVERHEAD))
    deliveries.hold()
    await deliveries.publish("_INBOX.bounded", b"a" * 100, ("alice", 1))
    for body in (b"b" * 100, b"c" * 100, b"d" * 100):
        await deliveries.publish("_INBOX.bounded", body, None)
    assert counters["held_replies_dropped"] == 1
    assert not deliveries.repoint(("alice", 1), "_INBOX.elsewhere")  # its dropped reply is forgotten too
    await deliveries.release()
    assert [(await asyncio.wait_for(received.get(), 5))[:1] for _ in range(3)] == [b"b", b"c", b"d"]
