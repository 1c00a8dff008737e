"""The gateway served in the test's event loop by uvicorn, on a port bound here, a raw HTTP/1.1
client for what the OpenAI SDK hides (the ``[DONE]`` line, a client that hangs up), and a
completion choice's logprob fields as the SDK reads them."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import uvicorn
from openai.types import CompletionChoice

from service.gateway.app import Gateway
from service.gateway.auth import ApiKeys
from service.gateway.server import uvicorn_config
from service.ops.settings import Settings

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer


@dataclass
class Served:
    gateway: Gateway
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@asynccontextmanager
async def serve_gateway(
    settings: Settings,
    api_keys: ApiKeys | None = None,
    send_buffer_bytes: int | None = None,
    tracer: Tracer | None = None,
) -> AsyncIterator[Served]:
    """A gateway connected to the coordinator of ``settings``, accepting on 127.0.0.1; with
    ``send_buffer_bytes``, its connections' kernel send buffers that small (``SO_SNDBUF``, which
    accepted sockets inherit), so a client that stops reading blocks its writes sooner;
    ``tracer``: where its spans go."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    gateway = Gateway(settings, api_keys or ApiKeys(), tracer)
    server = uvicorn.Server(uvicorn_config(gateway, settings))
    server.config.timeout_graceful_shutdown = 1
    serving = asyncio.ensure_future(server.serve(sockets=[listener]))
    try:
        await asyncio.wait_for(gateway.connected.wait(), 10)
        yield Served(gateway, listener.getsockname()[1])
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        listener.close()


@dataclass
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding") == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                return bytes(body)
            body += await reader.readexactly(size)
            await reader.readline()
    return await reader.readexactly(int(headers.get("content-length", "0")))


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers


def _request_bytes(method: str, path: str, body: bytes, headers: dict[str, str] | None) -> bytes:
    headers = {"Content-Type": "application/json", **(headers or {})}
    head = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def http(
    port: int,
    method: str,
    path: str,
    payload: Any = None,
    *,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> HttpResponse:
    """One request on a fresh connection; the whole response."""
    data = body if body is not None else (json.dumps(payload).encode() if payload is not None else b"")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_request_bytes(method, path, data, headers))
        status, response_headers = await _read_head(reader)
        return HttpResponse(status, response_headers, await _read_body(reader, response_headers))
    finally:
        writer.close()


async def hang_up_after(port: int, path: str, payload: Any, ready: Callable[[bytes], bool]) -> bytes:
    """Send a request, read until ``ready(what was read)``, then close the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    try:
        writer.write(_request_bytes("POST", path, json.dumps(payload).encode(), None))
        while not ready(received):
            chunk = await reader.read(4096)
            if not chunk:
                break
            received += chunk
        return received
    finally:
        writer.close()
        await writer.wait_closed()


def sse_data(body: bytes) -> list[str]:
    """The ``data:`` payloads of an event stream, in order."""
    return [line[len("data: ") :] for line in body.decode().split("\n\n") if line.startswith("data: ")]


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """For state with no event to wait on (an engine's load): check it every few milliseconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if condition():
            return
        if loop.time() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)


class Legacy(NamedTuple):
    """A completion choice's legacy logprob fields, each present."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def legacy_logprobs(choice: CompletionChoice) -> Legacy:
    logprobs = choice.logprobs
    assert logprobs is not None, "the choice carries no logprobs"
    fields = (logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset)
    tokens, token_logprobs, top_logprobs, text_offset = fields
    assert tokens is not None and token_logprobs is not None and top_logprobs is not None and text_offset is not None
    return Legacy(tokens, list(token_logprobs), list(top_logprobs), text_offset)
