"""Which port /healthz, /readyz and /metrics take: a port the operator chose binds or the process
fails before it joins the fleet; the default port, when taken, falls back to a free one with a
warning, so several services run on one host with default settings."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator

import pytest
from nats.aio.client import Client as NATS
from prometheus_client.registry import CollectorRegistry

from service.client import DpcoordClient
from service.ops.http_endpoints import HEALTH_PATH, READY_PATH, Check, HttpEndpoints
from service.ops.settings import Settings
from tests.conftest import make_settings

DEFAULT_PORT = Settings.model_fields["http_port"].default
SERVING = re.compile(r"health and metrics on http://[^:]+:(\d+)")


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process on this host is listening on."""
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        yield holder.getsockname()[1]


def endpoints(port: int, port_chosen: bool) -> HttpEndpoints:
    ok = Check(True, "fine")
    return HttpEndpoints("0.0.0.0", port, lambda: ok, lambda: ok, CollectorRegistry(), port_chosen=port_chosen)


async def http_status(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return int(head.split()[1])


async def test_a_chosen_port_that_is_taken_is_an_error_naming_it(taken_port: int) -> None:
    with pytest.raises(OSError, match=f"0.0.0.0:{taken_port} .*Address already in use.*--http-port"):
        await endpoints(taken_port, port_chosen=True).start()


async def test_the_default_port_when_taken_falls_back_to_a_free_one(
    taken_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "service.ops.http_endpoints")
    async with endpoints(taken_port, port_chosen=False) as served:
        assert served.port not in (taken_port, 0)
        assert await http_status(served.port, HEALTH_PATH) == 200
    warning = caplog.records[-1].getMessage()
    assert f"default HTTP port {taken_port} is taken" in warning and f"on port {served.port} instead" in warning


def service_env(settings: Settings) -> dict[str, str]:
    """A child's environment with this test's NATS and subjects and every other setting left at
    its default; the session fixture's DPCOORD_HTTP_PORT=0 is removed."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DPCOORD_")}
    return env | {"DPCOORD_NATS_URL": settings.nats_url, "DPCOORD_SUBJECT_PREFIX": settings.subject_prefix}


async def start(role: str, env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", role, *args, env=env, stderr=asyncio.subprocess.PIPE
    )


async def read_log(process: asyncio.subprocess.Process, until: str, timeout_s: float = 20.0) -> list[str]:
    """The child's log lines up to the first containing ``until``."""
    assert process.stderr is not None
    stderr = process.stderr
    lines: list[str] = []

    async def read() -> list[str]:
        while True:
            line = (await stderr.readline()).decode()
            if not line:
                raise AssertionError(f"exited ({await process.wait()}) before logging {until!r}: {lines}")
            lines.append(line)
            if until in line:
                return lines

    return await asyncio.wait_for(read(), timeout_s)


def served_port(lines: list[str]) -> int:
    return next(int(match[1]) for line in lines if (match := SERVING.search(line)))


async def test_a_coordinator_and_two_engines_on_one_host_with_default_settings(nats_url: str) -> None:
    """The README's separate-processes path: every process serves, whoever has the default port."""
    settings = make_settings(nats_url)
    env = service_env(settings)
    coordinator = await start("coordinator", env)
    processes = [coordinator]
    try:
        coordinator_port = served_port(await read_log(coordinator, "health and metrics on"))
        processes += [await start("engine", env, "--backend", "echo") for _ in range(2)]
        engine_ports = []
        for engine in processes[1:]:
            lines = await read_log(engine, "registered with coordinator")
            assert any(f"default HTTP port {DEFAULT_PORT} is taken" in line for line in lines), lines
            engine_ports.append(served_port(lines))
        assert len({coordinator_port, *engine_ports}) == 3
        for port in engine_ports:
            assert await http_status(port, READY_PATH) == 200
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while await http_status(coordinator_port, READY_PATH) != 200:  # it joins its arbitration first
            assert loop.time() < deadline, "the coordinator never became ready"
            await asyncio.sleep(0.05)
        async with await DpcoordClient.connect(settings) as client:
            assert (await client.submit("ok", max_tokens=2)).generated_text == "ok"
        assert [process.returncode for process in processes] == [None, None, None]
    finally:
        for process in processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        codes = [await asyncio.wait_for(process.wait(), 20) for process in processes]
    assert codes == [0, 0, 0]


async def test_an_engine_whose_chosen_port_is_taken_exits_before_registering(
    nats_url: str, nc: NATS, taken_port: int
) -> None:
    settings = make_settings(nats_url)
    registrations = await nc.subscribe(f"{settings.subject_prefix}.register")
    await nc.flush()
    engine = await start("engine", service_env(settings) | {"DPCOORD_HTTP_PORT": str(taken_port)}, "--backend", "echo")
    assert engine.stderr is not None
    _, stderr = await asyncio.wait_for(engine.communicate(), 30)
    assert engine.returncode == 1
    assert f"0.0.0.0:{taken_port} (Address already in use)" in stderr.decode()
    await nc.flush()
    assert registrations.pending_msgs == 0
