"""The stack the stalled-reader benchmark (benchmarks/stalled_readers.py) measures, and its
HTTP clients: nats-server, a coordinator, echo engines that serve ``/metrics`` (their generated
tokens are read there) and the gateway, each its own process (benchmarks/stack.py); streamed
completions read whole, not at all, or a byte a second."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.stack import BenchStack, StackConfig
from service.bus.server import free_port
from service.protocol.messages import Final
from service.protocol.subjects import Header

PROMPT = "The quick brown fox jumps over the lazy dog. "


def echo_text(max_tokens: int) -> str:
    """What an echo engine streams for the chat message PROMPT (engines/echo.py): the plain
    chat rendering, echoed byte by byte, ``max_tokens`` long."""
    rendered = f"user: {PROMPT}\nassistant:"
    return "".join(rendered[n % len(rendered)] for n in range(max_tokens))


def chat_request(port: int, max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "dpcoord-echo",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def stream_text(raw: bytes) -> tuple[str, bool]:
    """The content a chunked SSE response carried, and whether it ended with its one [DONE]."""
    body = bytearray()
    rest = raw[raw.index(b"\r\n\r\n") + 4 :]
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    pieces: list[str] = []
    for event in bytes(body).split(b"\n\n"):
        if event.startswith(b"data: {"):
            chunk = json.loads(event[6:])
            if "error" in chunk:
                return "".join(pieces), False
            for choice in chunk["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces), body.endswith(b"data: [DONE]\n\n") and body.count(b"[DONE]") == 1


async def read_stream(port: int, max_tokens: int) -> bool:
    """One streamed chat completion read as fast as it comes; whether it was exact."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    writer.write(chat_request(port, max_tokens))
    raw = await reader.read(-1)
    writer.close()
    text, done = stream_text(raw)
    return done and text == echo_text(max_tokens)


def open_stalled(port: int, max_tokens: int) -> socket.socket:
    """A streamed chat completion whose client reads nothing (a blocking socket, never read)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(chat_request(port, max_tokens))
    return sock


async def trickle(sock: socket.socket, stop: asyncio.Event) -> None:
    """Read a byte a second until ``stop``."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        await loop.sock_recv(sock, 1)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            continue


async def drain_whole(sock: socket.socket, max_tokens: int) -> bool:
    """Read a stalled stream to its end now; whether it was exact."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    raw = bytearray()
    while chunk := await loop.sock_recv(sock, 1 << 20):
        raw += chunk
    text, done = stream_text(bytes(raw))
    return done and text == echo_text(max_tokens)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class StalledStack(BenchStack):
    """A BenchStack whose engines serve /metrics, and whose gateway takes the flow settings."""

    def __init__(self, config: StackConfig, gateway_env: dict[str, str]) -> None:
        super().__init__(config)
        self._gateway_env = gateway_env
        self.metrics_ports: list[int] = []

    def _dpcoord_env(self) -> dict[str, str]:
        return super()._dpcoord_env() | self._gateway_env

    async def start_fleet(self, probe: bytes, timeout_s: float = 30.0) -> None:
        env = self._dpcoord_env()
        await self._spawn("coordinator", "-m", "service", "coordinator", env=env)
        for index in range(self.config.engines):
            port = free_port()
            self.metrics_ports.append(port)
            engine_env = env | {"DPCOORD_HTTP_PORT": str(port), "DPCOORD_ENGINE_ID": f"e{index}"}
            await self._spawn(f"engine{index}", "-m", "service", "engine", env=engine_env)
        seen: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while len(seen) < self.config.engines:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not come up in {timeout_s:g} s")
            self._check_children()
            reply = await self._try(self.subjects.coordinator(Header.SUBMIT_REQUEST), probe)
            if isinstance(reply, Final) and reply.engine_id:
                seen.add(reply.engine_id)
            else:
                await asyncio.sleep(0.05)  # waiting for processes to come up: nothing to await on

    async def generated_tokens(self) -> float:
        """The engines' dpcoord_engine_generated_tokens_total, summed."""
        total = 0.0
        for port in self.metrics_ports:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            raw = await reader.read(-1)
            writer.close()
            text = raw.partition(b"\r\n\r\n")[2].decode()
            for family in text_string_to_metric_families(text):
                if family.name == "dpcoord_engine_generated_tokens":
                    total += sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
        return total

    async def settled_tokens(self, quiet_s: float = 1.0, timeout_s: float = 60.0) -> float:
        """The engines' generated tokens once they stopped growing for ``quiet_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last, since = await self.generated_tokens(), loop.time()
        while loop.time() - since < quiet_s:
            if loop.time() > deadline:
                raise RuntimeError(f"the engines kept generating for {timeout_s:g} s")
            await asyncio.sleep(0.1)  # sampling a counter in another process: nothing to await on
            now = await self.generated_tokens()
            if now != last:
                last, since = now, loop.time()
        return last
