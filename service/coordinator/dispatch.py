"""The guarded dispatch: one NATS subscription per registered header, and every handler call
turned into an answer whatever happens.

Contract: a message whose NATS reply subject is not under an inbox prefix (or too long, or not
publishable) is dropped and counted (``unsafe_reply_subject``); the prefix it is under is its
owner (:attr:`Incoming.owner`). A body beyond the payload limit gets 413. A handler's
``WireError`` becomes an error reply with its code; any other failure is logged with its
traceback and answered with 500. A refusal goes to the body's ``reply_to`` when that is usable
(an inbox of the sender's own, or under the shared inbox prefix for a plain publish, which
names no sender), else to the NATS reply subject, and is counted as ``error_<code>``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from handlers.context import CoordinatorContext
from service.bus.direct import DirectSubscription
from service.bus.registry import HandlerRegistry, HandlerSpec, Incoming
from service.coordinator.core import Core
from service.ops.log_limit import RateLimitedLog
from service.protocol.codec import detect_encoding, encode, return_hints
from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import error_reply
from service.protocol.subjects import Header, ReplySubjects, publishable, utf8_length

log = logging.getLogger(__name__)


class Dispatch:
    def __init__(self, core: Core, context: CoordinatorContext, replies: ReplySubjects) -> None:
        self._core = core
        self._context = context  # what the handlers are given: the coordinator
        self._replies = replies
        self._owner_of = replies.inboxes.owner
        self._first_inbox, self._first_owner = replies.inboxes.first
        self._max_body = core.settings.max_payload_bytes
        self._max_reply = core.settings.max_id_bytes
        self._refusal_log = RateLimitedLog(log)
        self._failure_log = RateLimitedLog(log)
        self._subscriptions: dict[str, list[Subscription | DirectSubscription]] = {}
        self._handlers: HandlerRegistry[CoordinatorContext] | None = None
        self._handed: dict[str, HandlerSpec[CoordinatorContext]] = {}

    async def subscribe(self, handlers: HandlerRegistry[CoordinatorContext]) -> None:
        """Subscribe every header of ``handlers`` in its delivery mode; once connected, since the
        server's ``max_payload`` caps the bodies accepted."""
        core = self._core
        nc, subjects = core.nc, core.subjects
        self._handlers = handlers
        self._max_body = min(self._max_body, nc.max_payload)
        for header, spec in handlers.items():
            queue = "" if spec.fanout or spec.addressed else core.settings.queue_group
            own = subjects.addressed_to(header, core.id)
            served = [(own, "") if spec.addressed else (subjects.coordinator(header), queue)]
            if spec.per_sender:  # engines send as themselves; those of earlier releases on the plain subject
                served.append((subjects.sent_by_any(header), queue))
            if spec.per_replica:  # clients that address this replica alone
                served.append((own, ""))
            for subject, group in served:
                subscription: Subscription | DirectSubscription
                if spec.direct:
                    subscription = await nc.subscribe_direct(
                        subject, functools.partial(self.dispatch, spec), queue=group
                    )
                else:
                    subscription = await nc.subscribe(
                        subject, queue=group, cb=functools.partial(self._on_message, spec)
                    )
                self._subscriptions.setdefault(header, []).append(subscription)

    async def dispatch_as(
        self,
        header: str,
        serve: Callable[[CoordinatorContext, Incoming, Any], Awaitable[None]],
        reply: str,
        body: bytes,
    ) -> None:
        """A message another replica handed over as its sender sent it (reply subject and body):
        guarded as ``header``'s own (its payload type, every failure answered to the sender), but
        served by ``serve``, the one server of handed copies of ``header``."""
        spec = self._handed.get(header)
        if spec is None:
            served = self._handlers.get(header) if self._handlers is not None else None
            if served is None:
                raise WireError(ErrorCode.NOT_FOUND, f"this coordinator serves no {header}")
            spec = self._handed[header] = dataclasses.replace(served, fn=serve)
        await self.dispatch(spec, self._core.subjects.coordinator(header), reply, body)

    async def stop_admitting(self) -> None:
        """No more submissions reach this replica: the queue group hands them to its peers. Those
        the server sent before it took the unsubscribe are read (and admitted) before this returns:
        the flush's answer comes after them."""
        for subscription in self._subscriptions.pop(Header.SUBMIT_REQUEST, []):
            await subscription.unsubscribe()
        await self._core.nc.flush()

    async def close(self) -> None:
        for subscriptions in self._subscriptions.values():
            for subscription in subscriptions:
                await subscription.unsubscribe()
        self._subscriptions.clear()

    async def _on_message(self, spec: HandlerSpec[CoordinatorContext], msg: Msg) -> None:
        await self.dispatch(spec, msg.subject, msg.reply, msg.data)

    async def dispatch(
        self, spec: HandlerSpec[CoordinatorContext], subject: str, reply: str, body: bytes, headers: bytes | None = None
    ) -> None:
        """Decode, run the handler, answer any failure. ``subject`` is ``spec``'s own, or for a
        ``per_sender`` header ``<prefix>.<header>.<sender>``, which names the sender; ``headers``:
        the raw NATS header block of a direct message."""
        owner = None
        if reply:
            owner = self._first_owner if reply.startswith(self._first_inbox) else self._owner_of(reply)
            # self._replies.check, inline: under an inbox prefix, which settings keep apart from
            # dpcoord's own subjects, a well-formed subject needs only to fit max_id_bytes.
            too_long = len(reply) > self._max_reply or (not reply.isascii() and utf8_length(reply) > self._max_reply)
            if owner is None or too_long or not publishable(reply):
                self._core.counters["unsafe_reply_subject"] += 1
                self._refusal_log.warning(
                    "dropped %s (%d bytes): reply subject %r %s",
                    spec.header,
                    len(body),
                    reply[:256],
                    self._replies.check(reply)[1],
                )
                return
        # The sender a per_sender subject names; None on the plain subject (engines of earlier releases).
        prefix = self._core.subjects.prefix
        sender = (subject[len(prefix) + len(spec.header) + 2 :] or None) if spec.per_sender else None
        incoming = Incoming(spec.header, reply or None, detect_encoding(body), body, sender, owner, headers)
        try:
            if len(body) > self._max_body:
                raise WireError(
                    ErrorCode.TOO_LARGE, f"{len(body)} bytes exceeds the {self._max_body}-byte payload limit"
                )
            await spec.fn(self._context, incoming, spec.decoder.decode(body, incoming.encoding))
        except WireError as err:
            await self.refuse(incoming, err)
        except Exception:
            self._failure_log.exception("handler for %s failed", spec.header)
            await self.refuse(incoming, WireError(ErrorCode.INTERNAL, f"internal error handling {spec.header}"))

    async def refuse(self, incoming: Incoming, err: WireError) -> None:
        self._core.counters[f"error_{err.code}"] += 1
        hints = return_hints(incoming.body, incoming.encoding)
        reply_to = hints.reply_to if self._usable_reply_to(hints.reply_to, incoming.owner) else incoming.reply
        client_request_id = hints.client_request_id if isinstance(hints.client_request_id, (str, int)) else None
        self._refusal_log.warning(
            "refused %s (%d bytes, client_request_id=%s): %s %s",
            incoming.header,
            len(incoming.body),
            client_request_id,
            err.code,
            err.message,
        )
        if not reply_to:
            return
        nc = self._core.nc
        await nc.publish(reply_to, encode(error_reply(err, client_request_id), incoming.encoding))
        if hints.stream is True:
            await nc.publish(reply_to, b"")

    def _usable_reply_to(self, reply_to: object, sender: str | None) -> bool:
        """A ``reply_to`` read from a refused body: an inbox, the sender's own when it is known,
        else under the shared inbox prefix (a plain publish names no sender)."""
        if not isinstance(reply_to, str):
            return False
        owner, problem = self._replies.check(reply_to)
        return problem is None and owner == (self._first_owner if sender is None else sender)
