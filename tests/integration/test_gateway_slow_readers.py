"""Slow readers through the gateway, on real nats-server (docs/gateway.md, *Slow readers*): an
HTTP client that reads nothing of its stream has its request held in the engine (the tokens
generated for it stop growing) while streams read beside it stay exact; it gets every token
when it reads again; past the stall limit its request is aborted and the stream ends with a
408 ``stream_stalled`` event; a client that takes not even that has its connection aborted.

The stalled clients are plain sockets with a small receive buffer that the test does not read,
and the gateway's sockets have small send buffers, so the kernel holds a few hundred tokens of
a stream, not megabytes; the echo engines run at full speed."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.conftest import EngineFactory, make_settings
from tests.gateway_helpers import http, serve_gateway, sse_data, wait_until

BUFFER_BYTES = 65536  # the least gateway_stream_buffer_bytes
SEND_BUFFER_BYTES = 8192
MAX_TOKENS = 4000
CONTENT = "slow"


@pytest.fixture
def settings(nats_url: str) -> Settings:
    """A heartbeat timeout long enough that a loaded machine does not lose the one engine
    these streams run on (the test process runs all of it)."""
    return make_settings(nats_url, heartbeat_timeout_s=5.0)


def expected(max_tokens: int) -> str:
    rendered = f"user: {CONTENT}\nassistant:"  # the echo engine's plain chat rendering, echoed
    return "".join(rendered[n % len(rendered)] for n in range(max_tokens))


def chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": "dpcoord-echo",
        "messages": [{"role": "user", "content": CONTENT}],
        "max_tokens": max_tokens,
        "stream": True,
    }


def stalled(port: int, max_tokens: int) -> socket.socket:
    """A streamed chat completion whose client reads nothing (until the test reads it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(chat(max_tokens)).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    sock.sendall(head.encode() + body)
    sock.setblocking(False)
    return sock


async def read_to_end(sock: socket.socket) -> bytes:
    """What the stalled client reads now, to the end of the connection (a reset ends it too)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # a small window reads slowly
    loop = asyncio.get_running_loop()
    raw = bytearray()
    try:
        while chunk := await loop.sock_recv(sock, 1 << 16):
            raw += chunk
    except ConnectionResetError:
        pass
    sock.close()
    return bytes(raw)


def dechunk(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:80]
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    return bytes(body)


def content(events: list[str]) -> str:
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    return "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])


def with_flow(settings: Settings, stall_s: float) -> Settings:
    return settings.model_copy(update={"gateway_stream_buffer_bytes": BUFFER_BYTES, "gateway_stream_stall_s": stall_s})


async def test_a_client_that_reads_nothing_is_held_beside_normal_streams_and_gets_it_all_when_it_reads(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    [engine] = await start_engines(1)
    async with serve_gateway(with_flow(settings, 60.0), send_buffer_bytes=SEND_BUFFER_BYTES) as served:
        sock = stalled(served.port, MAX_TOKENS)
        await wait_until(lambda: len(engine.requests.held_back()) == 1, timeout_s=30)
        [request_id] = engine.requests.held_back()
        first = await http(served.port, "POST", "/v1/chat/completions", chat(50))  # the step in flight is recorded
        held_at = len(engine.requests.records[request_id].tokens)
        assert held_at < MAX_TOKENS // 2  # held long before its end
        beside = await asyncio.gather(*(http(served.port, "POST", "/v1/chat/completions", chat(300)) for _ in range(3)))
        assert content(sse_data(first.body)) == expected(50)
        assert all(content(sse_data(response.body)) == expected(300) for response in beside)
        assert len(engine.requests.records[request_id].tokens) == held_at  # 300 steps, not a token more
        events = sse_data(dechunk(await read_to_end(sock)))
    assert events[-1] == "[DONE]" and content(events) == expected(MAX_TOKENS)
    assert engine.counters["releases"] >= 1


async def test_past_the_stall_limit_the_request_is_aborted_and_the_stream_ends_with_408(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    [engine] = await start_engines(1)
    async with serve_gateway(with_flow(settings, 1.0), send_buffer_bytes=SEND_BUFFER_BYTES) as served:
        sock = stalled(served.port, MAX_TOKENS)
        await wait_until(lambda: len(engine.requests.held_back()) == 1, timeout_s=30)
        [request_id] = engine.requests.held_back()
        await wait_until(lambda: request_id not in engine.requests)  # aborted: the engine freed it
        events = sse_data(dechunk(await read_to_end(sock)))
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "stream_stalled" and "took nothing for 1 s" in error["message"]
        assert expected(MAX_TOKENS).startswith(content(events[:-2]))  # what came before it, in order

        never = stalled(served.port, MAX_TOKENS)  # a client that never reads again
        await wait_until(lambda: len(served.gateway.requests) == 1)
        await wait_until(lambda: len(served.gateway.requests) == 0, timeout_s=30)  # the connection was aborted
        await read_to_end(never)
