"""Direct subscriptions (service/bus/direct.py) against a real nats-server, and the nats-py
hook they rely on: these fail first if a nats-py release changes it."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from service.bus.connection import flush_subscriptions
from service.bus.direct import DirectClient


@pytest.fixture
async def direct(nats_url: str) -> AsyncIterator[DirectClient]:
    client = DirectClient()
    await client.connect(nats_url)
    yield client
    await client.close()


def test_nats_py_still_has_the_hook_and_the_sid() -> None:
    assert list(inspect.signature(NATS._process_msg).parameters) == [
        "self",
        "sid",
        "subject",
        "reply",
        "data",
        "headers",
    ]
    assert "self._id = id" in inspect.getsource(Subscription.__init__)


async def test_direct_handler_gets_subject_reply_body_and_headers_in_order(direct: DirectClient, nc: NATS) -> None:
    got: list[tuple[str, str, bytes]] = []
    headers: list[bytes | None] = []
    done = asyncio.Event()

    async def handler(subject: str, reply: str, body: bytes, header_block: bytes | None) -> None:
        got.append((subject, reply, body))
        headers.append(header_block)
        if len(got) == 3:
            done.set()

    await direct.subscribe_direct("direct.test.*", handler)
    await flush_subscriptions(direct)
    await nc.publish("direct.test.a", b"1", reply="inbox.1")
    await nc.publish("direct.test.b", b"2")
    await nc.publish("direct.test.a", b"", headers={"K": "V"})
    await asyncio.wait_for(done.wait(), 5)
    assert got == [("direct.test.a", "inbox.1", b"1"), ("direct.test.b", "", b"2"), ("direct.test.a", "", b"")]
    assert headers[:2] == [None, None]
    assert headers[2] is not None and headers[2].startswith(b"NATS/1.0") and b"K: V" in headers[2]
    assert direct.stats["in_msgs"] >= 3


async def test_a_failing_handler_is_logged_and_the_next_message_still_arrives(
    direct: DirectClient, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    second = asyncio.Event()

    async def handler(subject: str, reply: str, body: bytes, headers: bytes | None) -> None:
        if body == b"boom":
            raise ValueError("boom")
        second.set()

    await direct.subscribe_direct("direct.fail", handler)
    await flush_subscriptions(direct)
    with caplog.at_level(logging.ERROR, logger="service.bus.direct"):
        await nc.publish("direct.fail", b"boom")
        await nc.publish("direct.fail", b"fine")
        await asyncio.wait_for(second.wait(), 5)
    assert any("direct handler for direct.fail failed" in record.getMessage() for record in caplog.records)
    assert direct.is_connected


async def test_unsubscribed_direct_handler_hears_nothing_more(direct: DirectClient, nc: NATS) -> None:
    heard: list[bytes] = []
    first, marker = asyncio.Event(), asyncio.Event()

    async def handler(subject: str, reply: str, body: bytes, headers: bytes | None) -> None:
        heard.append(body)
        first.set()

    async def on_marker(subject: str, reply: str, body: bytes, headers: bytes | None) -> None:
        marker.set()

    subscription = await direct.subscribe_direct("direct.unsub", handler)
    await direct.subscribe_direct("direct.unsub.marker", on_marker)
    await flush_subscriptions(direct)
    await nc.publish("direct.unsub", b"before")
    await asyncio.wait_for(first.wait(), 5)
    await subscription.unsubscribe()
    await flush_subscriptions(direct)  # the server has the UNSUB
    await nc.publish("direct.unsub", b"after")
    # One publisher's messages reach one subscriber in order: once the marker is in, "after"
    # would have been too.
    await nc.publish("direct.unsub.marker", b"")
    await asyncio.wait_for(marker.wait(), 5)
    assert heard == [b"before"]


async def test_ordinary_subscriptions_on_a_direct_client_behave_as_in_nats_py(
    direct: DirectClient, nats_url: str
) -> None:
    async def handler(subject: str, reply: str, body: bytes, headers: bytes | None) -> None:
        await direct.publish(reply, b"direct:" + body)

    await direct.subscribe_direct("direct.echo", handler)
    sub = await direct.subscribe("plain.subject")
    await flush_subscriptions(direct)
    other = await nats.connect(nats_url)
    try:
        answer = await other.request("direct.echo", b"hi", timeout=5)
        assert answer.data == b"direct:hi"
        await other.publish("plain.subject", b"x", headers={"A": "b"})
        msg = await sub.next_msg(timeout=5)
        assert (msg.subject, msg.data, msg.headers) == ("plain.subject", b"x", {"A": "b"})
        # request() on the direct client itself uses nats-py's own inbox subscription
        mirrored = await direct.request("direct.echo", b"again", timeout=5)
        assert mirrored.data == b"direct:again"
    finally:
        await other.close()


async def test_inline_handler_gets_raw_subject_body_and_headers_and_no_responders_status(
    direct: DirectClient, nc: NATS
) -> None:
    """An inline subscription (the client library's reply inbox) hears raw bytes, the header
    block included, so NATS's no-responders status (an empty body with ``NATS/1.0 503``) is
    told apart from an empty message; a failing handler is logged, and the reader goes on."""
    got: list[tuple[bytes, bytes, bytes | None]] = []
    three = asyncio.Event()

    def handler(subject: bytes, body: bytes, headers: bytes | None) -> None:
        got.append((subject, body, headers))
        if body == b"boom":
            raise RuntimeError("boom")
        if len(got) == 4:
            three.set()

    inbox = direct.new_inbox()
    subscription = await direct.subscribe_inline(f"{inbox}.*", handler)
    await flush_subscriptions(direct)
    await nc.publish(f"{inbox}.1", b"reply")
    await nc.publish(f"{inbox}.2", b"boom")
    await nc.publish(f"{inbox}.1", b"", headers={"K": "V"})
    await nc.flush()  # the three are delivered in order on their connection; the status comes on another
    await direct.publish("direct.nobody.listens", b"ask", reply=f"{inbox}.3")  # the server answers 503
    await asyncio.wait_for(three.wait(), 5)
    published = [message for message in got if message[0] != f"{inbox}.3".encode()]
    assert published[0] == (f"{inbox}.1".encode(), b"reply", None)
    assert published[2][1] == b"" and published[2][2] is not None and b"K: V" in published[2][2]
    [status] = [message for message in got if message[0] == f"{inbox}.3".encode()]
    assert status[0] == f"{inbox}.3".encode() and status[1] == b""
    assert status[2] is not None and status[2].startswith(b"NATS/1.0 503")
    assert direct.is_connected
    await subscription.unsubscribe()
