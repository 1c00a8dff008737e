"""One submission of the client library, from its first publish to its terminal reply.

:meth:`Submission.replies` hands over the replies that arrived together (one wake-up of the
reader for all of them, so a reader that writes them out together, as the gateway's streams do,
pays its own per-reply costs once per batch), in arrival order, ending with the terminal one. On
the way it resubmits when a reply may have been lost (the rules are the client library's,
service/client/__init__.py): after NATS's no-responders status, with backoff until the deadline;
after a reconnect; when the replica holding the request stops heartbeating. Every publish after
the first is marked as a resubmission (but for a repeat after no-responders, which reached no
one). Each publish goes to the replica arbitrating the id, when the client knows one (else, or
once that replica answers no-responders or NATS refuses its subject, to the subject all
replicas share, whose replica hands it to the arbiter).

An error (an error reply's ClientError, the deadline's TimeoutError, a refused publish's 403) is
raised after the replies that came before it were handed over: a reader never loses a reply.

Every publish of a submission carries the same NATS ``headers`` (a traced one's ``traceparent``).
A :class:`~service.protocol.messages.Held` notice (the fleet is paused) goes to ``on_held``,
never to the reader. A stream with flow control (:mod:`service.client.flow`) is the exception
to the rule above: when it stalls, the replies its reader did not take are dropped and the
next call raises ``StreamStalled``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

import msgspec

from service.client.calls import ClientError, check, reply_decoder
from service.client.exchanges import (
    ADDRESS_REFUSED,
    EXPIRED,
    NO_RESPONDERS,
    RECONNECTED,
    CoordinatorLost,
    CoordinatorWatch,
    Exchanges,
    Refused,
)
from service.client.flow import FlowControl, StreamFlow, StreamStalled
from service.protocol.codec import encode_msgpack
from service.protocol.errors import ErrorCode
from service.protocol.messages import Final, Held, Partial, SubmitEnvelope

MAX_RESUBMIT_BACKOFF_S = 1.0
# The coordinator enforces the same deadline; waiting a little longer lets its 504 arrive
# instead of a bare timeout.
DEADLINE_MARGIN_S = 2.0
Publish = Callable[[bytes, str, str | None, Mapping[str, str] | None], Awaitable[None]]
"""``publish(body, reply_subject, subject, headers)``: a publish to ``subject``, a replica's
own submission subject, or (None) the one all replicas share."""
Address = Callable[[], "str | None"]
"""The own submission subject of the replica arbitrating the submission's id, as the client
knows the replicas now; None for the subject all replicas share."""
OnHeld = Callable[[Held], None]

_envelope_decoder = msgspec.msgpack.Decoder(SubmitEnvelope)


class Submission:
    """One envelope ``body`` in flight; :meth:`start` publishes it, :meth:`close` (always, in a
    ``finally``) forgets its reply subject. With ``flow``, its replies not read are bounded."""

    __slots__ = (
        "_address", "_again", "_backoff", "_body", "_deadline", "_ended", "_exchanges", "_failure", "_flow",
        "_headers", "_inbox", "_mailbox", "_on_held", "_publish", "_request_id", "_sent_to", "_timeout", "_watch",
    )  # fmt: skip

    def __init__(
        self,
        publish: Publish,
        exchanges: Exchanges,
        watch: CoordinatorWatch,
        body: bytes,
        timeout: float,
        flow: FlowControl | None = None,
        headers: Mapping[str, str] | None = None,
        on_held: OnHeld | None = None,
        address: Address | None = None,
    ) -> None:
        wait_s = timeout + DEADLINE_MARGIN_S
        self._deadline = time.monotonic() + wait_s
        self._inbox, self._mailbox = exchanges.open(wait_s)
        self._exchanges = exchanges
        self._publish = publish
        self._watch = watch
        self._body = body
        self._timeout = timeout
        self._backoff = 0.02
        # the request's id, once a reply named it: its first part names the replica holding it
        self._request_id: str | None = None
        self._again: bytes | None = None  # the body marked as a resubmission, made at the first one
        self._ended = False
        self._failure: ClientError | TimeoutError | None = None  # raised at the next call
        self._headers = headers
        self._on_held = on_held
        self._address = address
        self._sent_to: str | None = None  # the subject of the last publish (None: the shared one)
        self._flow: StreamFlow | None = None
        if flow is not None:
            inbox = self._inbox
            self._flow = StreamFlow(self._mailbox, flow, lambda: self._request_id, lambda: exchanges.close(inbox))

    async def start(self) -> None:
        await self._send(self._body)

    async def _send(self, body: bytes) -> None:
        """To the arbiter of the id when the client knows it, else to every replica's subject."""
        self._sent_to = self._address() if self._address is not None else None
        await self._publish(body, self._inbox, self._sent_to, self._headers)

    def close(self) -> None:
        self._exchanges.close(self._inbox)
        if self._flow is not None:
            self._flow.close()

    async def replies(self) -> list[Partial | Final]:
        """The replies that arrived since the last call (waiting for one), in order; the last
        list ends with the terminal reply, and a call after it returns ``[]``."""
        if self._failure is not None:
            raise self._failure
        ready: list[Partial | Final] = []
        try:
            while not (ready or self._ended):
                for item in await self._mailbox.take():
                    if not isinstance(item, bytes):
                        await self._control(item)
                        continue
                    if not item:  # the end-of-stream marker
                        self._ended = True
                        break
                    reply = check(reply_decoder.decode(item))
                    if isinstance(reply, (Partial, Final)):
                        if reply.request_id != self._request_id:
                            self._request_id = reply.request_id
                            self._watch.heard_of(self._holder())
                        ready.append(reply)
                        if isinstance(reply, Final):
                            self._ended = True
                            break
                    elif isinstance(reply, Held) and self._on_held is not None:
                        self._on_held(reply)
        except (ClientError, TimeoutError) as exc:
            if not ready:
                raise
            self._failure = exc
        return ready

    def _holder(self) -> str:
        """The replica holding the request, as its id names it."""
        return (self._request_id or "").rpartition("-")[0]

    async def _control(self, item: object) -> None:
        """What the mailbox hears besides replies: resubmit, or fail."""
        if item is NO_RESPONDERS and self._sent_to is not None:
            # The arbiter the client knew is gone: any replica hands the copy to the new one.
            self._address = None
            await self._send(self._body)
        elif item is NO_RESPONDERS:
            await asyncio.sleep(min(self._backoff, max(0.0, self._deadline - time.monotonic())))
            self._backoff = min(self._backoff * 2, MAX_RESUBMIT_BACKOFF_S)
            await self._send(self._body)
        elif item is ADDRESS_REFUSED:
            if self._sent_to is not None:
                self._address = None
                await self._send(self._again or self._body)
        elif item is EXPIRED:
            raise TimeoutError(f"no reply within {self._timeout} s")
        elif isinstance(item, CoordinatorLost) and self._request_id and self._holder() != item.coordinator_id:
            return
        elif item is RECONNECTED or isinstance(item, CoordinatorLost):
            self._again = self._again or _as_resubmission(self._body)
            await self._send(self._again)
            if self._flow is not None:
                self._flow.again()
        elif isinstance(item, Refused):
            raise ClientError(ErrorCode.FORBIDDEN, item.message)
        elif isinstance(item, StreamStalled):
            raise item


def _as_resubmission(body: bytes) -> bytes:
    return encode_msgpack(msgspec.structs.replace(_envelope_decoder.decode(body), resubmission=True))
