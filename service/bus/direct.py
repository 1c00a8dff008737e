"""nats-py with direct subscriptions, so the hot path skips nats-py's per-message machinery.

nats-py hands each message of a callback subscription to that subscription's own queue and
task, building a ``Msg`` on the way: more of the coordinator's CPU per message than routing
the request costs (measured in docs/performance.md). A
direct subscription's handler is awaited by nats-py's reading task as soon as the message is
parsed, with just the subject, the reply subject and the body.

The contract of a direct handler: it must never wait for another NATS message (a request's
answer, an acknowledgement), because the task that would read that message is the one
running the handler. Publishing is fine. Messages are handled one at a time in arrival
order; the NATS header block is passed on raw (``None`` without one), unparsed: a handler that
reads a header parses only what it reads (:func:`service.ops.tracing.traceparent_in`). An
exception is logged, never raised into the reader.

An inline subscription (:meth:`DirectClient.subscribe_inline`) goes one step further for a
reader that only files each message away (the client library's reply inbox): its handler is a
plain function called with the raw subject, body and NATS header block (``None`` without one;
a no-responders status is ``NATS/1.0 503``), so a message costs no coroutine at all. It must not
block; an exception is logged, as for a direct handler.

nats-py has no public hook for this, so :class:`DirectClient` overrides its protected
``_process_msg`` and reads a subscription's sid; tests/integration/test_direct_nats.py fails if a nats-py
release changes either. Every other subscription behaves exactly as in nats-py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)

DirectHandler = Callable[[str, str, bytes, bytes | None], Awaitable[None]]
"""``handler(subject, reply_subject, body, headers)``; the reply subject is ``""`` when the sender
gave none, ``headers`` the raw NATS header block, ``None`` without one."""
InlineHandler = Callable[[bytes, bytes, bytes | None], None]
"""``handler(subject, body, headers)``, all raw bytes; ``headers`` is ``None`` without a header block."""


class DirectSubscription:
    """What :meth:`DirectClient.subscribe_direct` returns: it can only be unsubscribed."""

    def __init__(self, client: DirectClient, subscription: Subscription) -> None:
        self._client = client
        self._subscription = subscription

    @property
    def subject(self) -> str:
        return self._subscription.subject

    async def unsubscribe(self) -> None:
        self._client.forget_direct(self._subscription)
        await self._subscription.unsubscribe()


class DirectClient(NATS):
    def __init__(self) -> None:
        super().__init__()
        self._direct: dict[int, DirectHandler] = {}
        self._inline: dict[int, InlineHandler] = {}

    async def subscribe_direct(self, subject: str, handler: DirectHandler, queue: str = "") -> DirectSubscription:
        """Subscribe ``handler`` (see the module docstring for its contract); it survives reconnects."""
        subscription = await self.subscribe(subject, queue=queue)
        self._direct[subscription._id] = handler
        return DirectSubscription(self, subscription)

    async def subscribe_inline(self, subject: str, handler: InlineHandler) -> DirectSubscription:
        """Subscribe ``handler`` (see the module docstring for its contract); it survives reconnects."""
        subscription = await self.subscribe(subject)
        self._inline[subscription._id] = handler
        return DirectSubscription(self, subscription)

    def forget_direct(self, subscription: Subscription) -> None:
        self._direct.pop(subscription._id, None)
        self._inline.pop(subscription._id, None)

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        inline = self._inline.get(sid)
        if inline is not None:
            self.stats["in_msgs"] += 1
            self.stats["in_bytes"] += len(data)
            try:
                inline(subject, data, headers or None)
            except Exception:
                log.exception("inline handler for %s failed", subject.decode(errors="replace"))
            return
        handler = self._direct.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]  # None: no headers
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        try:
            await handler(subject.decode(), reply.decode() if reply else "", data, headers)
        except Exception:
            log.exception("direct handler for %s failed", subject.decode(errors="replace"))
