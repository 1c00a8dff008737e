"""The client library's side of backpressure on the wire (docs/protocol.md, *Backpressure*):
``hold_request`` publishes and the abort of a stalled stream, for :mod:`service.client.flow`.

A hold is published, not awaited: it carries a reply subject under the client's inbox (the
coordinator checks the request's owner by it, as for aborts), on a token no submission uses,
so its ``ack`` is dropped on arrival at no cost. Both are best effort; what fails is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS

from service.client.calls import ClientError
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode
from service.protocol.messages import HoldRequest

log = logging.getLogger(__name__)

FLOW_TOKEN = "f"  # the last token of the reply subject holds go with: no submission's
ABORT_TIMEOUT_S = 5.0


class HoldChannel:
    """``send`` and ``abort`` of :class:`service.client.flow.HoldSender`, over one connection."""

    def __init__(self, nc: NATS, subject: str, inbox: str, abort: Callable[..., Awaitable[object]]) -> None:
        self._nc = nc
        self._subject = subject
        self._reply = f"{inbox}.{FLOW_TOKEN}"
        self._abort = abort  # the client's abort, by request id

    async def send(self, request_id: str, held: bool, seq: int) -> None:
        await self._nc.publish(self._subject, encode_msgpack(HoldRequest(request_id, held, seq)), reply=self._reply)

    async def abort(self, request_id: str) -> None:
        try:
            await self._abort(request_id=request_id, timeout=ABORT_TIMEOUT_S)
        except ClientError as exc:
            if exc.code != ErrorCode.NOT_FOUND:  # else it ended meanwhile
                log.warning("abort of stalled request_id=%s failed: %s", request_id, exc)
        except TimeoutError as exc:
            log.warning("abort of stalled request_id=%s not answered: %s", request_id, exc)
