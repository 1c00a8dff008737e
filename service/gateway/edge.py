"""The gateway's HTTP edge: uvicorn's httptools protocol with the bounds a public server needs.

Stock uvicorn (0.54, the version this is tested with) bounds none of these on its httptools path: httptools
buffers a header field of any size before uvicorn sees it (a 100 MB header was read in full),
nothing times out a connection that has not sent its request head (idle or a byte at a time),
and its ``limit_concurrency`` answers per request in plain text rather than capping connections.
uvicorn takes the protocol class as ``Config(http=...)``, so :class:`EdgeProtocol` adds them:

- a request head (request line and header fields) of more than ``max_header_bytes`` bytes, or
  with more than ``max_headers`` fields, is answered 431 and the connection closed: the bytes are
  counted as they arrive, before the parser has buffered a whole field;
- a request, head and body, must arrive within ``read_timeout_s`` of the connection opening, or
  of the first byte of a later request on it (bytes trickling in do not extend it), else 408 and
  close (a new connection that sent nothing is closed without a word). The timer is armed only
  for a request that did not arrive whole in one read, so the common request costs none;
- an idle keep-alive connection is closed after uvicorn's ``timeout_keep_alive``;
- a connection beyond ``max_connections`` is answered 503 at once and closed;
- a connection whose writes stay blocked for ``write_stall_s`` (its client takes nothing of
  what it was sent, not even the error event that ends a stalled stream) is aborted: what waits
  for it is freed;
- while the server drains (service/gateway/server.py), every response closes its connection.

Each request's scope carries the connection's :class:`Departure` as the ASGI extension
``dpcoord.departure`` (``scope["extensions"]["dpcoord.departure"]["departure"]``): callbacks run
when the connection is lost, so a handler learns that its client left without a task waiting on
``receive()`` for the whole request.

Each refusal is an OpenAI error body (service/gateway/errors.py) with ``Connection: close``.

Writes are corked (:class:`CorkedTransport`): what a connection is sent during one turn of the
event loop leaves in one ``write`` at the end of that turn, so a response's head and body (which
uvicorn writes apart) are one system call, as are the SSE events of a stream that are ready
together. On this 2-core machine a loopback write costs more than the rest of a bare response.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.gateway.errors import GatewayError

DEPARTURE = "dpcoord.departure"


class Departure:
    """Callbacks run once when the connection is lost (``gone`` from then on)."""

    __slots__ = ("_callbacks", "gone")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], object]] = []
        self.gone = False

    def add(self, callback: Callable[[], object]) -> None:
        self._callbacks.append(callback)

    def discard(self, callback: Callable[[], object]) -> None:
        with contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def fire(self) -> None:
        self.gone = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


def departure_of(scope: Any) -> Departure | None:
    """The connection's Departure, when the server is this edge."""
    extension = (scope.get("extensions") or {}).get(DEPARTURE)
    return extension.get("departure") if extension is not None else None


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_header_bytes: int = 16384
    max_headers: int = 100
    read_timeout_s: float = 10.0
    max_connections: int = 4096
    write_stall_s: float = 120.0


class EdgeProtocol(HttpToolsProtocol):
    """One HTTP connection; :func:`edge_protocol` makes the class for a set of limits."""

    limits: ClassVar[EdgeLimits] = EdgeLimits()
    draining: ClassVar[staticmethod[[], bool]] = staticmethod(lambda: False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # before a request head ends: bytes arriving now count towards it
        self._head_bytes = 0
        self._message_done = True  # the last request arrived in full, body included
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._departure = Departure()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CorkedTransport(transport, self.loop))
        if len(self.connections) > self.limits.max_connections:
            self._refuse(GatewayError(503, "too many connections; try again later", code="too_many_connections"))
            return
        self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        self._cancel_write_timer()
        self._departure.fire()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._refused:
            return
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(self._too_large())
        elif self._read_timer is None and not self._message_done:  # a request arriving in pieces
            self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    # parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {DEPARTURE: {"departure": self._departure}}
        self._message_done = False

    def on_headers_complete(self) -> None:
        self._in_head = False
        if len(self.headers) > self.limits.max_headers:  # their bytes are bounded as they arrive
            self._refuse(self._too_large())
            return
        super().on_headers_complete()
        if self.cycle is not None and self.draining():
            self.cycle.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_read_timer()
        self._message_done = True
        self._in_head = True
        self._head_bytes = 0
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._message_done:  # answered before its body was read (401, 413, ...): stop reading it
            self.transport.close()

    # bounds

    def _too_large(self) -> GatewayError:
        limits = self.limits
        return GatewayError(
            431,
            f"the request head exceeds {limits.max_header_bytes} bytes or {limits.max_headers} header fields",
            code="request_header_fields_too_large",
        )

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        """The client took nothing for ``write_stall_s``: abort, dropping what waits for it."""
        self._write_timer = None
        self.transport.abort()

    def _read_timed_out(self) -> None:
        """The request (head or body) is late. Its handler, if it runs, waits for the body: it
        has answered nothing yet (one that answers early has its connection closed), and sees the
        connection go."""
        self._read_timer = None
        if self._message_done and self._head_bytes == 0:  # nothing of a request yet: close without a word
            self.transport.close()
            return
        seconds = f"{self.limits.read_timeout_s:g}"
        self._refuse(GatewayError(408, f"the request did not arrive within {seconds} s", code="request_timeout"))

    def _refuse(self, err: GatewayError) -> None:
        """Answer ``err`` and close, reading nothing more from this connection."""
        self._refused = True
        self._cancel_read_timer()
        transport = self.transport
        if transport.is_closing():
            return
        body = err.body()
        head = (
            f"HTTP/1.1 {err.status} {_REASONS.get(err.status, 'Error')}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        transport.write(head.encode() + body)
        # A close with unread bytes sends a reset, which can destroy the answer on its way: end
        # the sending side, discard what still comes in (data_received), close a moment later.
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()


class CorkedTransport(asyncio.Transport):
    """A transport whose writes of one event-loop turn go out together, at the end of the turn;
    everything else passes through, after what is waiting (close, EOF) or instead of it (abort)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(None)
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        pending = self._pending
        if not pending:
            self._loop.call_soon(self._flush)
        pending.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(data) for data in self._pending)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


LINGER_S = 1.0  # seconds a refused connection is read (and discarded) before it is closed
_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def edge_protocol(limits: EdgeLimits, draining: Callable[[], bool] = lambda: False) -> type[EdgeProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``limits``; ``draining``
    says whether the server drains."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits, "draining": staticmethod(draining)})
