"""An HTTP/1.1 load generator for the gateway benchmark: keep-alive connections on asyncio
streams, one request at a time on each, bodies encoded once.

A general HTTP client (httpx, the OpenAI SDK) spends more CPU per request than the gateway
does, and on a 2-core machine the load generator shares the cores with what it measures; this
one parses only the status line, ``Content-Length`` and chunked transfer coding.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

_DONE = b"data: [DONE]\n\n"


class HttpError(Exception):
    pass


class Connection:
    """One keep-alive connection; ``request`` sends a prepared request and reads the response."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self._writer.write(raw)
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = -1
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            return status, await self._chunked()
        if length < 0:
            raise HttpError(f"response without length: {head!r}")
        return status, await self._reader.readexactly(length)

    async def _chunked(self) -> bytes:
        body = bytearray()
        reader = self._reader
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return bytes(body)
            body += await reader.readexactly(size + 2)
            del body[-2:]

    def close(self) -> None:
        self._writer.close()


async def wait_listening(port: int, check: Callable[[], None], timeout_s: float, what: str) -> None:
    """Return once 127.0.0.1:``port`` accepts a connection; ``check`` raises if the process
    that should listen there has died."""
    for _ in range(int(timeout_s / 0.05)):
        check()
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)  # waiting for a process to come up: nothing to await on
    raise RuntimeError(f"{what} did not listen within {timeout_s:g} s")


def post(host: str, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def check(status: int, body: bytes, stream: bool) -> bool:
    """A successful response: 200, and a stream that ends with its one ``[DONE]``."""
    return status == 200 and (not stream or (body.endswith(_DONE) and body.count(b"[DONE]") == 1))


async def sequential(connection: Connection, raw: bytes, count: int, stream: bool) -> tuple[list[float], int]:
    """Latencies in microseconds of ``count`` requests one after another, and the errors."""
    latencies = []
    errors = 0
    for _ in range(count):
        started = time.perf_counter_ns()
        status, body = await connection.request(raw)
        latencies.append((time.perf_counter_ns() - started) / 1000)
        errors += not check(status, body, stream)
    return latencies, errors


class Pipelined:
    """``connections`` workers, each sending its next request as soon as the last is answered;
    with ``rate`` (requests/s in all), each waits for its next slot too, so the server sees that
    rate spread over the connections (an open-loop pace, as long as the server keeps up)."""

    def __init__(
        self, host: str, port: int, raw: bytes, connections: int, stream: bool, rate: float | None = None
    ) -> None:
        self._host, self._port, self._raw, self._stream = host, port, raw, stream
        self._connections = connections
        self._interval = connections / rate if rate else 0.0
        self.completed = 0
        self.errors = 0
        self.latencies: list[float] = []
        self._recording = False

    def record(self, on: bool) -> None:
        self._recording = on

    async def run_until(self, stop: asyncio.Event) -> None:
        async def worker(index: int) -> None:
            connection = await Connection.open(self._host, self._port)
            interval = self._interval
            slot = time.perf_counter() + interval * index / self._connections
            try:
                while not stop.is_set():
                    if interval:
                        slot += interval
                        wait = slot - time.perf_counter()
                        if wait > 0:
                            await asyncio.sleep(wait)  # the pace itself: there is nothing to await
                    started = time.perf_counter_ns()
                    status, body = await connection.request(self._raw)
                    self.completed += 1
                    self.errors += not check(status, body, self._stream)
                    if self._recording:
                        self.latencies.append((time.perf_counter_ns() - started) / 1000)
            finally:
                connection.close()

        await asyncio.gather(*(worker(index) for index in range(self._connections)))
