"""The gateway as a process (``dpcoord gateway``): on SIGTERM it fails readiness and takes no
new work, lets requests finish within ``gateway_drain_s``, ends the streams still running with an
error event and ``[DONE]`` and the non-streamed requests with a 503 error body, and exits 0;
meanwhile it still answers probes on new connections (503). With ``--workers N`` several
processes share its port."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import IO, Any

import openai
import pytest

from service.bus.server import free_port
from service.coordinator.coordinator import Coordinator
from service.gateway.app import Gateway
from service.gateway.auth import ApiKeys
from service.ops.settings import Settings
from tests.conftest import EngineFactory
from tests.gateway_helpers import http, sse_data, wait_until
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


def _start_gateway(settings: Settings, port: int, log: IO[str], *args: str, **env: str) -> subprocess.Popen[bytes]:
    """``dpcoord gateway`` as a process on ``port``, its standard error to ``log``."""
    environment = dict(
        os.environ,
        DPCOORD_NATS_URL=settings.nats_url,
        DPCOORD_SUBJECT_PREFIX=settings.subject_prefix,
        DPCOORD_GATEWAY_HOST="127.0.0.1",
        DPCOORD_GATEWAY_PORT=str(port),
        **env,
    )
    return subprocess.Popen(
        [sys.executable, "-m", "service", "gateway", *args], env=environment, cwd=REPO_ROOT, stderr=log
    )


async def _first_stream(port: int, max_tokens: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream opened as soon as the gateway is connected and an engine serves."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while True:
        try:
            return await _open_stream(port, max_tokens)
        except (OSError, TimeoutError):
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _readyz(gateway: Gateway) -> int:
    """Call the app's /readyz directly (the listening socket is closed by then)."""
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: MutableMapping[str, Any]) -> None:
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
    log = (tmp_path / "gateway.log").open("w")
    gateway = _start_gateway(settings, port, log, DPCOORD_GATEWAY_DRAIN_S=str(DRAIN_S))
    try:
        short = await _first_stream(port, max_tokens=10)  # about 0.5 s: within the drain
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


async def test_while_draining_probes_get_503_new_work_is_refused_and_a_cut_request_gets_an_error_body(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, tmp_path: Path
) -> None:
    """During the drain, a new connection is still answered: ``/readyz`` and ``/health`` 503,
    ``/healthz`` 200, a new completion 503 ``shutting_down``, each closing its connection. A
    non-streamed request still running at the deadline gets a 503 ``shutting_down`` error body
    (the ``openai`` SDK raises it as an APIStatusError), not a dropped connection."""
    await start_engines(1, token_delay_ms=50)
    port = free_port()
    log = (tmp_path / "gateway.log").open("w")
    gateway = _start_gateway(settings, port, log, DPCOORD_GATEWAY_DRAIN_S="3")
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        stream = await _first_stream(port, max_tokens=2000)  # about 100 s: cut
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        long = asyncio.ensure_future(client.completions.create(model=ECHO, prompt="Hello", max_tokens=2000))

        async def in_flight() -> float:
            return _metric((await http(port, "GET", "/metrics")).body.decode(), "dpcoord_gateway_requests_in_flight")

        while await in_flight() < 2:  # the non-streamed request is being served
            assert loop.time() < deadline and not long.done(), (tmp_path / "gateway.log").read_text()
            await asyncio.sleep(0.05)
        gateway.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await wait_until(lambda: "gateway draining" in (tmp_path / "gateway.log").read_text())

        ready, health, alive = await asyncio.gather(
            *(http(port, "GET", path) for path in ("/readyz", "/health", "/healthz"))
        )
        assert (ready.status, health.status, alive.status) == (503, 503, 200)
        assert ready.body == b"not ok: draining\n" and ready.headers["connection"] == "close"
        refused = await http(port, "POST", "/v1/completions", {"model": ECHO, "prompt": "hi", "max_tokens": 2})
        assert refused.status == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["connection"] == "close"

        with pytest.raises(openai.APIStatusError) as cut:
            await asyncio.wait_for(long, 15)
        assert cut.value.status_code == 503 and time.monotonic() - signalled >= 2.5
        assert isinstance(cut.value.body, dict) and cut.value.body["code"] == "shutting_down"
        events = await _rest(*stream)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert await asyncio.to_thread(gateway.wait, 10) == 0, (tmp_path / "gateway.log").read_text()
        with pytest.raises(OSError):  # the drain over, the socket no longer listens
            await http(port, "GET", "/readyz")
    finally:
        await client.close()
        if gateway.poll() is None:
            gateway.kill()
        gateway.wait()
        log.close()


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def test_workers_share_the_port_and_stop_with_the_gateway(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, tmp_path: Path
) -> None:
    """``--workers 2``: two processes accept on one port (SO_REUSEPORT spreads new connections
    over them, so each counted some of the requests but none all of them), and both exit 0 on
    SIGTERM."""
    await start_engines(1)
    port = free_port()
    log = (tmp_path / "gateway.log").open("w")
    gateway = _start_gateway(settings, port, log, "--workers", "2")
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        served = 0
        counted: set[float] = set()
        while len(counted) < 2 or 0 in counted:  # until both have served (the second starts a moment later)
            assert loop.time() < deadline, (counted, (tmp_path / "gateway.log").read_text())
            for _ in range(20):  # each on a new connection
                try:
                    payload = {"model": ECHO, "prompt": "hi", "max_tokens": 2}
                    served += (await http(port, "POST", "/v1/completions", payload)).status == 200
                except OSError:
                    await asyncio.sleep(0.1)  # not listening yet
            if not served:  # the first process is not listening yet
                continue
            counted = set()
            for _ in range(30):
                metrics = (await http(port, "GET", "/metrics")).body.decode()
                counted.add(_metric(metrics, 'dpcoord_gateway_requests_total{endpoint="completions",status="200"}'))
        assert all(0 < count < served for count in counted) and sum(counted) == served, (counted, served)
        workers = [int(pid) for pid in Path(f"/proc/{gateway.pid}/task/{gateway.pid}/children").read_text().split()]
        assert len(workers) == 1
        gateway.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(gateway.wait, 20) == 0
        assert (
            not Path(f"/proc/{workers[0]}").exists() or "Z" in Path(f"/proc/{workers[0]}/stat").read_text().split()[2]
        )
    finally:
        if gateway.poll() is None:
            gateway.kill()
        gateway.wait()
        log.close()
