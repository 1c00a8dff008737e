"""Drain: on SIGTERM the gateway (a real ``dpcoord gateway`` process) fails readiness and stops
accepting, lets streams finish within ``gateway_drain_s``, ends those still running with an error
event and ``[DONE]``, and exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from service.bus.server import free_port
from service.coordinator.coordinator import Coordinator
from service.gateway.app import Gateway
from service.gateway.auth import ApiKeys
from service.ops.settings import Settings
from tests.conftest import EngineFactory
from tests.gateway_helpers import sse_data
from tests.helpers import REPO_ROOT

ECHO = "dpcoord-echo"
DRAIN_S = 1.5


async def _open_stream(port: int, max_tokens: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    body = json.dumps({"model": ECHO, "prompt": "Hello", "max_tokens": max_tokens, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = b""
    while b"data: " not in received:  # the stream began
        received += await asyncio.wait_for(reader.read(4096), 10)
    return reader, writer


async def _rest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> list[str]:
    received = b""
    while b"data: [DONE]" not in received:
        chunk = await asyncio.wait_for(reader.read(65536), 15)
        if not chunk:
            break
        received += chunk
    writer.close()
    # Chunked transfer encoding: keep the event lines, drop the chunk-size lines.
    lines = [line for line in received.split(b"\r\n") if line.startswith(b"data: ") or b"\n\ndata: " in line]
    return sse_data(b"".join(lines))


async def _readyz(gateway: Gateway) -> int:
    """Call the app's /readyz directly (the listening socket is closed by then)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gateway({"type": "http", "method": "GET", "path": "/readyz", "headers": []}, receive, send)
    return int(sent[0]["status"])


async def test_readiness_fails_while_draining(settings: Settings) -> None:
    gateway = Gateway(settings, ApiKeys())
    gateway.draining = True
    assert await _readyz(gateway) == 503


async def test_sigterm_lets_short_streams_finish_and_cuts_long_ones_with_an_error_then_done(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, tmp_path: Path
) -> None:
    await start_engines(1, token_delay_ms=50)
    port = free_port()
    env = dict(
        os.environ,
        DPCOORD_NATS_URL=settings.nats_url,
        DPCOORD_SUBJECT_PREFIX=settings.subject_prefix,
        DPCOORD_GATEWAY_HOST="127.0.0.1",
        DPCOORD_GATEWAY_PORT=str(port),
        DPCOORD_GATEWAY_DRAIN_S=str(DRAIN_S),
    )
    log = (tmp_path / "gateway.log").open("w")
    gateway = subprocess.Popen([sys.executable, "-m", "service", "gateway"], env=env, cwd=REPO_ROOT, stderr=log)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while True:  # until the gateway is connected and an engine serves
            try:
                short = await _open_stream(port, max_tokens=10)  # about 0.5 s: within the drain
                break
            except (OSError, TimeoutError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.1)
        long = await _open_stream(port, max_tokens=2000)  # about 100 s: cut
        gateway.send_signal(signal.SIGTERM)
        finished, cut = await asyncio.gather(_rest(*short), _rest(*long))
        assert finished[-1] == "[DONE]" and json.loads(finished[-2])["choices"][0]["finish_reason"] == "length"
        assert cut.count("[DONE]") == 1 and cut[-1] == "[DONE]"
        assert json.loads(cut[-2])["error"]["code"] == "shutting_down"
        code = await asyncio.to_thread(gateway.wait, DRAIN_S + 10)
        assert code == 0, (tmp_path / "gateway.log").read_text()
    finally:
        if gateway.poll() is None:
            gateway.kill()
        gateway.wait()
        log.close()
