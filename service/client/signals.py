"""A control signal that is always answered, even when the replica taking it dies.

The coordinator replica that takes a signal writes the shared control record, broadcasts it to
every engine and answers once all confirmed: for a drain pause, minutes later. Should it die
meanwhile (or should NATS reconnect, losing the answer), the caller would wait out its timeout
for nothing while the fleet goes on into the new state. So the signal is a request-reply on a
submission's reply inbox (:class:`~service.client.exchanges.Exchanges`), which hears of replicas
that stop heartbeating and of reconnects, and after either the same signal goes again, marked
``retry`` (:class:`~service.protocol.messages.ControlSignal`): whichever replica takes it finds
the record its signal wrote, broadcasts it again under that revision and answers once every
engine confirmed. Which replica took the first one is not known, so any replica lost counts;
an extra retry is answered like the first, and the first answer wins.
"""

from __future__ import annotations

import msgspec
from nats.aio.client import Client as NATS

from service.bus.refusals import PublishRefusals
from service.client.calls import ClientError, check, reply_decoder
from service.client.exchanges import (
    EXPIRED,
    NO_RESPONDERS,
    RECONNECTED,
    CoordinatorLost,
    CoordinatorWatch,
    Exchanges,
)
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode
from service.protocol.messages import Ack, ControlSignal


async def signal_answered(
    nc: NATS,
    refusals: PublishRefusals,
    exchanges: Exchanges,
    watch: CoordinatorWatch,
    subject: str,
    signal: ControlSignal,
    timeout: float,
) -> Ack:
    """Send ``signal`` on ``subject`` and return its ``Ack``, sending it again (as a retry) when a
    replica stopped heartbeating or NATS reconnected meanwhile. A client that just connected
    first hears every replica (within 1.5 heartbeat intervals): the one taking the signal
    could otherwise die unnoticed. Raises ClientError for an error answer (503 when no
    coordinator listens, 403 when NATS refuses the publish), TimeoutError after ``timeout``."""
    await watch.heard_all()
    inbox, mailbox = exchanges.open(timeout)
    refused: list[str] = []

    def on_refused(message: str) -> None:
        refused.append(message)
        mailbox.put_nowait(None)  # wakes the reader

    try:
        with refusals.watch(subject, on_refused):
            await nc.publish(subject, encode_msgpack(signal), reply=inbox)
            again = encode_msgpack(msgspec.structs.replace(signal, retry=True))
            while True:
                for item in await mailbox.take():
                    if refused:
                        raise ClientError(ErrorCode.FORBIDDEN, refused[0])
                    if isinstance(item, bytes) and item:
                        reply = check(reply_decoder.decode(item))
                        if not isinstance(reply, Ack):
                            raise ClientError(ErrorCode.INTERNAL, f"unexpected reply on {subject}: {reply!r}")
                        return reply
                    if item is EXPIRED:
                        raise TimeoutError(f"no reply on {subject} within {timeout} s")
                    if item is NO_RESPONDERS:
                        raise ClientError(ErrorCode.NO_ENGINE, f"no coordinator is listening on {subject}")
                    if item is RECONNECTED or isinstance(item, CoordinatorLost):
                        await nc.publish(subject, again, reply=inbox)
    finally:
        exchanges.close(inbox)
