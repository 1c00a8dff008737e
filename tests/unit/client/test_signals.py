"""A control signal of the client library (service/client/signals.py): sent again, marked
``retry``, when a replica stops heartbeating or NATS reconnects, until an answer comes; the
first answer wins. The publishes go to a test double of the connection (no NATS here: the real
round trip, with a replica SIGKILLed, is tests/faults/test_replica_death.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from service.bus.refusals import PublishRefusals
from service.client.calls import ClientError
from service.client.exchanges import EXPIRED, CoordinatorWatch, Exchanges
from service.client.signals import signal_answered
from service.protocol.codec import encode_msgpack
from service.protocol.messages import Ack, ControlSignal, ErrorBody, ErrorReply


class Bus:
    """Test double of the connection: records (subject, body, reply) of each publish."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, str]] = []
        self.published = asyncio.Event()

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "") -> None:
        self.sent.append((subject, payload, reply))
        self.published.set()

    async def next_publish(self) -> tuple[str, bytes, str]:
        await asyncio.wait_for(self.published.wait(), 5)
        self.published.clear()
        return self.sent[-1]


def sent(bus: Bus, exchanges: Exchanges, subject: str, signal: ControlSignal) -> asyncio.Future[object]:
    """The call in flight, on the double (a watch that has heard every replica at once)."""
    watch = CoordinatorWatch(exchanges, 0.0, 1.0)
    return asyncio.ensure_future(signal_answered(bus, PublishRefusals(), exchanges, watch, subject, signal, 10.0))  # type: ignore[arg-type]


def mailbox_token(reply: str) -> bytes:
    return reply.rpartition(".")[2].encode()


async def test_a_signal_goes_again_as_a_retry_when_a_replica_is_lost_and_the_first_answer_wins() -> None:
    bus, exchanges = Bus(), Exchanges()
    exchanges.inbox = "_INBOX.me"
    call = sent(bus, exchanges, "p.pause", ControlSignal(mode="drain"))
    subject, body, reply = await bus.next_publish()
    assert subject == "p.pause" and not msgspec.msgpack.decode(body, type=ControlSignal).retry
    exchanges.coordinator_lost("c1")  # perhaps the one taking it
    _, again, same_reply = await bus.next_publish()
    assert msgspec.msgpack.decode(again, type=ControlSignal) == ControlSignal(mode="drain", retry=True)
    assert same_reply == reply
    exchanges.on_inline(reply.encode(), encode_msgpack(Ack("pause", state="paused", revision=3)), None)
    exchanges.on_inline(reply.encode(), encode_msgpack(Ack("pause", state="paused", revision=3)), None)
    assert await call == Ack("pause", state="paused", revision=3)
    assert mailbox_token(reply) not in exchanges.queues  # the second answer has nowhere to go


async def test_an_error_answer_and_the_deadline_are_raised() -> None:
    bus, exchanges = Bus(), Exchanges()
    exchanges.inbox = "_INBOX.me"
    refusal = encode_msgpack(ErrorReply(ErrorBody(409, "unpause is not allowed in state suspended")))
    call = sent(bus, exchanges, "p.unpause", ControlSignal())
    _, _, reply = await bus.next_publish()
    exchanges.on_inline(reply.encode(), refusal, None)
    with pytest.raises(ClientError) as raised:
        await call
    assert raised.value.code == 409 and "suspended" in raised.value.message
    call = sent(bus, exchanges, "p.stop", ControlSignal())
    _, _, reply = await bus.next_publish()
    exchanges.queues[mailbox_token(reply)].put_nowait(EXPIRED)
    with pytest.raises(TimeoutError):
        await call
