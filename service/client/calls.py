"""Request-reply calls of the client library: one reply, or ClientError with the wire code.

A publish that NATS refuses (permissions violation) raises ClientError 403 at once, since NATS
reports the refusal only to the connection's error callback (:mod:`service.bus.refusals`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from service.bus.refusals import PublishRefusals
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import ErrorReply, Reply

reply_decoder = msgspec.msgpack.Decoder(Reply)
T = TypeVar("T")


class ClientError(WireError):
    """The coordinator or an engine answered with an error reply."""


def check(reply: Reply) -> Reply:
    if isinstance(reply, ErrorReply):
        raise ClientError(reply.error.code, reply.error.message)
    return reply


async def call(nc: NATS, refusals: PublishRefusals, subject: str, message: msgspec.Struct, timeout: float) -> Reply:
    return await call_raw(nc, refusals, subject, encode_msgpack(message), timeout)


async def call_raw(nc: NATS, refusals: PublishRefusals, subject: str, body: bytes, timeout: float) -> Reply:
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    try:

        def on_refusal(message: str) -> None:
            if not refused.done():
                refused.set_result(message)

        with refusals.watch(subject, on_refusal):
            msg = await unless_refused(nc.request(subject, body, timeout=timeout), refused)
    except NoRespondersError:
        raise ClientError(ErrorCode.NO_ENGINE, f"no coordinator is listening on {subject}") from None
    except NatsTimeoutError:
        raise TimeoutError(f"no reply on {subject} within {timeout} s") from None
    return check(reply_decoder.decode(msg.data))


async def unless_refused(waiting: Awaitable[T], refused: asyncio.Future[str]) -> T:
    """What ``waiting`` returns, or ClientError 403 as soon as NATS refuses the publish it
    waits on."""
    task = asyncio.ensure_future(waiting)
    try:
        await asyncio.wait((task, refused), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if refused.done() and (task.cancelled() or task.exception() is not None):
        raise ClientError(ErrorCode.FORBIDDEN, refused.result())
    return task.result()
