"""Flow control of one stream: a reader that falls behind holds its request's generation.

Contract (docs/reliability.md, *Slow readers*), for a stream whose mailbox may hold ``limit``
bytes of replies not taken (:mod:`service.client.mailbox` counts them):

- Past ``limit``, the client asks that the request be held (``hold_request`` with
  ``held: true``): its engine stops stepping it, keeping it in its batch. Should replies keep
  coming (a hold lost, a migration to another engine, an engine that predates holds), the hold
  is sent again each time another quarter of ``limit`` arrives.
- Once the reader has taken the mailbox down to half of ``limit``, the client releases it
  (``held: false``) and the engine steps it again. Each hold and release carries the next
  ``seq``, so an engine that gets two out of order keeps the newer. A release may be lost
  (a NATS reconnect, a replica dying on the way): while its reader waits with nothing to
  read, it is sent again after 1, 2 and 4 s, and the state is sent again after a reconnect or
  the loss of the replica holding the request.
- Held for ``stall_s`` without the reader draining it: the stream stalled. Unless its end has
  arrived already, the request is aborted upstream, the replies not taken are dropped (nothing
  more is delivered to it), and the reader's next read raises :class:`StreamStalled` (408).
- Past twice ``limit`` (only an engine that does not hold gets there), the same at once:
  nothing can bound the stream's memory otherwise, and dropping replies would break the
  stream. A terminal reply (final or error) that brings it there is kept: nothing runs then.

Holds and releases are messages only a stream that falls behind sends: a reader that keeps up
costs nothing here beyond two comparisons per reply. They are best effort (an unanswered one is
logged): the stall limit and the bound on memory hold whatever becomes of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from service.client.calls import ClientError
from service.client.mailbox import NEVER, NOT_HELD, Mailbox
from service.protocol.errors import ErrorCode

log = logging.getLogger(__name__)

# The client library's defaults (the gateway's are its settings gateway_stream_buffer_bytes and
# gateway_stream_stall_s, of the same values).
STREAM_BUFFER_BYTES = 1 << 20
STREAM_STALL_S = 60.0
RELEASE_CHECKS_S = (1.0, 2.0, 4.0)  # a release is sent again after these, while the reader starves


@dataclass(frozen=True, slots=True)
class FlowLimits:
    """A stream's bounds: bytes of replies not read before it is held, and seconds held with
    its reader taking nothing before it is aborted."""

    buffer_bytes: int = STREAM_BUFFER_BYTES
    stall_s: float = STREAM_STALL_S


DEFAULT_FLOW = FlowLimits()


class HoldSender(Protocol):
    """How a stream's flow reaches upstream (service/client/holds.py)."""

    async def send(self, request_id: str, held: bool, seq: int) -> None:
        """Publish a ``hold_request``."""

    async def abort(self, request_id: str) -> None:
        """Abort the request upstream."""


@dataclass(frozen=True, slots=True)
class FlowControl:
    """What a stream's flow needs from its client: its bounds and how to hold and abort."""

    limits: FlowLimits
    holds: HoldSender


class StreamStalled(ClientError):
    """The stream's reader took nothing for the stall limit: its request was aborted (408)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.STALLED, message)


class _Kind(msgspec.Struct):
    """What flow control reads of a reply body: its kind and request id, nothing else decoded."""

    type: str = ""
    request_id: str | None = None


_kind_decoder = msgspec.msgpack.Decoder(_Kind)
TERMINAL_KINDS = frozenset({"final", "error"})


class StreamFlow:
    """Watches one stream's mailbox (its :class:`~service.client.mailbox.Watcher`)."""

    def __init__(
        self,
        mailbox: Mailbox,
        control: FlowControl,
        request_id: Callable[[], str | None],
        stop_delivery: Callable[[], None],
    ) -> None:
        self._mailbox = mailbox
        limit = self._limit = control.limits.buffer_bytes
        self._step = max(1, limit // 4)
        self._stall_s = control.limits.stall_s
        self._request_id = request_id
        self._send = control.holds.send
        self._abort = control.holds.abort
        self._stop_delivery = stop_delivery
        self._loop = asyncio.get_running_loop()
        self._seq = 0
        self._named: str | None = None  # the request id a waiting reply named, before the reader read one
        self._stall: asyncio.TimerHandle | None = None
        self._check: asyncio.TimerHandle | None = None
        self._checks = 0  # releases sent again since the last release
        self._tasks: set[asyncio.Future[None]] = set()
        self.held = False
        self.stalled: StreamStalled | None = None
        mailbox.watcher = self
        mailbox.alarm = limit

    # the mailbox's Watcher

    def filled(self, unread: int) -> None:
        if unread > 2 * self._limit:
            if not self._ended():
                self._give_up(f"its reader fell {unread} bytes behind and its engine did not hold it")
            return
        self._mailbox.alarm = unread + self._step
        self._mailbox.release_at = self._limit // 2
        if not self.held:
            self.held = True
            self._stall = self._loop.call_later(self._stall_s, self._stalled)
        self._signal(True)

    def drained(self, unread: int) -> None:
        self.held = False
        self._cancel_stall()
        self._mailbox.alarm = self._limit
        self._mailbox.release_at = NOT_HELD
        self._signal(False)
        self._checks = 0
        self._check_later()

    # what may have lost a hold or a release

    def again(self) -> None:
        """A reconnect, or the replica holding the request lost: send the state again."""
        if self._seq and self.stalled is None:
            self._signal(self.held)

    def _check_later(self) -> None:
        self._cancel_check()
        if self._checks < len(RELEASE_CHECKS_S):
            self._check = self._loop.call_later(RELEASE_CHECKS_S[self._checks], self._released_yet)

    def _released_yet(self) -> None:
        """After a release: a reader still waiting with nothing to read may wait on a lost
        release (or on a slow engine: then the release is one message too many)."""
        self._check = None
        if not self.held and self.stalled is None and self._mailbox.starving():
            self._checks += 1
            self._signal(False)
            self._check_later()

    # the stream's end

    def close(self) -> None:
        """The reader is done with the stream: a request still held is released (it runs to its
        end, as a stream closed early always did)."""
        self._cancel_stall()
        self._cancel_check()
        mailbox = self._mailbox
        mailbox.watcher = None
        mailbox.alarm, mailbox.release_at = NEVER, NOT_HELD
        if self.held and self.stalled is None:
            self.held = False
            self._signal(False)

    # inside

    def _stalled(self) -> None:
        self._stall = None
        if not self._ended():
            self._give_up(f"its reader took nothing for {self._stall_s:g} s")

    def _ended(self) -> bool:
        """Whether the newest reply waiting is the stream's end: the end marker, a final or an error."""
        newest = self._mailbox.newest()
        if not isinstance(newest, bytes):
            return False
        if not newest:
            return True
        kind = _kind_of(newest)
        return kind is not None and kind.type in TERMINAL_KINDS

    def _request(self) -> str | None:
        """The request's id: as the reader learnt it, else as a reply waiting named it (kept:
        the reader may take them all before it reads one)."""
        request_id = self._request_id() or self._named
        if request_id is None:
            newest = self._mailbox.newest()
            kind = _kind_of(newest) if isinstance(newest, bytes) and newest else None
            request_id = self._named = kind.request_id if kind is not None else None
        return request_id

    def _give_up(self, why: str) -> None:
        """Abort the request, drop what waits, and fail the reader's next read."""
        self._cancel_stall()
        self._cancel_check()
        request_id = self._request()
        self.stalled = StreamStalled(f"stream of request {request_id} stopped: {why}; the request was aborted")
        self._stop_delivery()
        mailbox = self._mailbox
        mailbox.watcher = None
        mailbox.alarm, mailbox.release_at = NEVER, NOT_HELD
        mailbox.discard()
        mailbox.put_nowait(self.stalled)
        log.warning("%s", self.stalled.message)
        if request_id is not None:
            self._spawn(self._abort(request_id))

    def _signal(self, held: bool) -> None:
        request_id = self._request()
        if request_id is None:
            return
        self._seq += 1
        self._spawn(self._send(request_id, held, self._seq))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("flow control of a stream failed: %s", task.exception())

    def _cancel_check(self) -> None:
        if self._check is not None:
            self._check.cancel()
            self._check = None

    def _cancel_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None


def _kind_of(body: bytes) -> _Kind | None:
    try:
        return _kind_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
