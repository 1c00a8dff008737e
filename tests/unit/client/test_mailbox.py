"""The client library's per-submission mailbox: arrival order, one deadline for the whole
submission, and markers told to every submission in progress."""

from __future__ import annotations

import asyncio

import pytest

from service.client.exchanges import DEADLINE_RESOLUTION_S, EXPIRED, NO_RESPONDERS, Exchanges, Refused
from service.client.mailbox import Mailbox
from service.protocol.reply_batches import batch_subject, encode_batch


async def test_a_reader_takes_every_item_ready_in_arrival_order_and_waits_for_the_next() -> None:
    mailbox = Mailbox(asyncio.get_running_loop())
    mailbox.put_nowait("a")
    mailbox.put_nowait("b")
    assert await mailbox.take() == ["a", "b"]
    waiting = asyncio.ensure_future(mailbox.take())
    await asyncio.sleep(0)
    assert not waiting.done()
    mailbox.put_nowait("c")
    assert await asyncio.wait_for(waiting, 1.0) == ["c"]


async def test_the_deadline_arrives_after_what_came_before_it_and_within_its_bucket() -> None:
    exchanges = Exchanges()
    loop = asyncio.get_running_loop()
    opened = loop.time()
    subject, mailbox = exchanges.open(0.01)
    _, later = exchanges.open(10.0)
    mailbox.put_nowait("reply")
    assert await mailbox.take() == ["reply"]
    assert await asyncio.wait_for(mailbox.take(), 1.0) == [EXPIRED]
    assert loop.time() - opened < 0.01 + DEADLINE_RESOLUTION_S + 0.05
    exchanges.close(subject)
    with pytest.raises(TimeoutError):  # a later deadline is another bucket's
        await asyncio.wait_for(later.take(), 0.1)


async def test_a_closed_mailbox_never_expires() -> None:
    exchanges = Exchanges()
    subject, mailbox = exchanges.open(0.01)
    exchanges.close(subject)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(mailbox.take(), 0.2)


async def test_a_refusal_reaches_every_submission_in_progress_and_a_closed_one_no_more() -> None:
    exchanges = Exchanges()
    exchanges.inbox = "_INBOX.test"
    first_subject, first = exchanges.open(60.0)
    second_subject, second = exchanges.open(60.0)
    assert first_subject != second_subject and first_subject.startswith("_INBOX.test.")
    exchanges.close(second_subject)
    exchanges.refused("NATS refused the publish to x: permissions violation")
    [told] = await first.take()
    assert isinstance(told, Refused) and "permissions violation" in told.message
    assert list(exchanges.queues) == [first_subject.rpartition(".")[2].encode()]
    exchanges.close(first_subject)


async def test_an_inline_reply_is_queued_as_its_body_and_the_no_responders_status_as_a_marker() -> None:
    exchanges = Exchanges()
    exchanges.inbox = "_INBOX.test"
    subject, mailbox = exchanges.open(60.0)
    raw = subject.encode()
    exchanges.on_inline(raw, b"\x81", None)
    exchanges.on_inline(raw, b"", b"NATS/1.0\r\nK: V\r\n\r\n")  # an empty message: the end marker
    exchanges.on_inline(raw, b"", b"NATS/1.0 503\r\n\r\n")
    exchanges.on_inline(b"_INBOX.test.999", b"late", None)  # a submission that ended: dropped
    assert await mailbox.take() == [b"\x81", b"", NO_RESPONDERS]
    exchanges.close(subject)


async def test_a_reply_batch_is_split_into_its_submissions_mailboxes_in_order(caplog: pytest.LogCaptureFixture) -> None:
    exchanges = Exchanges()
    exchanges.inbox = "_INBOX.me"
    first, one = exchanges.open(60.0)
    second, two = exchanges.open(60.0)
    assert batch_subject(first) == batch_subject(second) == "_INBOX.me.b"
    token, other = first.rpartition(".")[2].encode(), second.rpartition(".")[2].encode()
    batch = encode_batch([(token, b"1a"), (other, b"2a"), (b"999", b"late"), (token, b"")])
    exchanges.on_inline(b"_INBOX.me.b", batch, None)
    assert [await one.take(), await two.take()] == [[b"1a", b""], [b"2a"]]
    exchanges.on_inline(b"_INBOX.me.b", b"\xc1not msgpack", None)  # dropped, and said
    assert "reply batch of 12 bytes dropped" in caplog.text
    exchanges.on_inline(second.encode(), b"2b", None)  # replies alone still arrive as ever
    assert await two.take() == [b"2b"]
    exchanges.close(first)
    exchanges.close(second)
