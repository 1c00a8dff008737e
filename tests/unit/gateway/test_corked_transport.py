"""The HTTP edge's corked transport (service/gateway/edge.py): what one turn of the event loop
writes to a connection leaves as one write, in order, before a close or an EOF; an abort drops
it."""

from __future__ import annotations

import asyncio
from typing import Any

from service.gateway.edge import CorkedTransport


class RecordingTransport(asyncio.Transport):
    """A test double of a socket transport: records the writes and the close."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        self.events.append("write")

    def close(self) -> None:
        self.closing = True
        self.events.append("close")

    def write_eof(self) -> None:
        self.events.append("eof")

    def abort(self) -> None:
        self.closing = True
        self.events.append("abort")

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return 0


async def _next_turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_the_writes_of_one_turn_leave_as_one_write_at_its_end() -> None:
    inner = RecordingTransport()
    corked = CorkedTransport(inner, asyncio.get_running_loop())
    corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
    corked.write(bytearray(b"body"))
    corked.write(b"")
    assert inner.writes == [] and corked.get_write_buffer_size() == 23
    await _next_turn()
    assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    corked.write(b"next")
    await _next_turn()
    assert inner.writes[1:] == [b"next"]


async def test_close_and_eof_send_what_waits_first_and_abort_drops_it() -> None:
    inner = RecordingTransport()
    corked = CorkedTransport(inner, asyncio.get_running_loop())
    corked.write(b"answer")
    corked.write_eof()
    corked.close()
    assert inner.events == ["write", "eof", "close"] and inner.writes == [b"answer"]
    await _next_turn()
    assert inner.writes == [b"answer"]

    aborted = RecordingTransport()
    corked = CorkedTransport(aborted, asyncio.get_running_loop())
    corked.write(b"lost")
    corked.abort()
    await _next_turn()
    assert aborted.events == ["abort"]
