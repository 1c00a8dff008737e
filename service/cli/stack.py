"""``dpcoord up``: an embedded nats-server (unless a NATS URL is given), one coordinator and N
engines as child processes, stopped together on Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import msgspec
from nats.errors import Error as NatsError

from service.bus.connection import close_nats, connect_nats
from service.bus.server import EmbeddedNatsServer, free_port
from service.client import ClientError, DpcoordClient
from service.ops.services_api import CoordinatorStatus
from service.ops.settings import Settings
from service.protocol.subjects import Subjects

log = logging.getLogger(__name__)


def _child_env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    for name in settings.model_fields_set:
        value = getattr(settings, name)
        if value is not None:
            env[f"DPCOORD_{name.upper()}"] = str(value)
    return env


_PORT_ENV = "DPCOORD_HTTP_PORT"


def http_ports(settings: Settings, engines: int) -> list[int]:
    """HTTP ports of the coordinator and each engine: free ports unless --http-port was given
    (then consecutive ports from it), all 0 (off) for --http-port 0."""
    if "http_port" not in settings.model_fields_set:
        return [free_port() for _ in range(engines + 1)]
    if settings.http_port == 0:
        return [0] * (engines + 1)
    return [settings.http_port + offset for offset in range(engines + 1)]


def _http_lines(ports: list[int]) -> str:
    if not ports[0]:
        return ""
    lines = f"Health and metrics: http://127.0.0.1:{ports[0]}/metrics (coordinator; also /healthz, /readyz)\n"
    if len(ports) > 1:
        lines += f"   engines on ports {', '.join(str(port) for port in ports[1:])}\n"
    return lines


async def _wait_for_coordinator(settings: Settings, timeout_s: float = 30.0) -> DpcoordClient:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await DpcoordClient.connect(settings, timeout=2.0)
        except (ClientError, TimeoutError):
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _wait_for_engines(settings: Settings, coordinator_id: str, count: int, timeout_s: float = 300.0) -> None:
    """Until the coordinator's status lists ``count`` engines: a torch engine loads its model first."""
    subject = Subjects(settings.subject_prefix).status("coordinator", coordinator_id)
    nc = await connect_nats(settings, name="dpcoord-up")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while True:
            try:
                reply = await nc.request(subject, b"", timeout=2.0)
                if len(msgspec.json.decode(reply.data, type=CoordinatorStatus).engines) >= count:
                    return
            except (NatsError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.debug("coordinator status not read yet: %s", exc)
            if loop.time() > deadline:
                raise TimeoutError(f"{count} engine(s) did not register within {timeout_s:g} s")
            await asyncio.sleep(0.2)
    finally:
        await close_nats(nc)


async def run_stack(settings: Settings, engines: int, model: str | None) -> int:
    server: EmbeddedNatsServer | None = None
    if "nats_url" not in settings.model_fields_set:
        server = EmbeddedNatsServer().start()
        settings = settings.model_copy(update={"nats_url": server.url})
        settings.model_fields_set.add("nats_url")
    env = _child_env(settings)
    if "cpu_threads" not in settings.model_fields_set:
        # Engines sharing one machine's cores must not each start a thread per core.
        env["DPCOORD_CPU_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(engines, 1)))
    ports = http_ports(settings, engines)
    python = [sys.executable, "-m", "service"]
    engine_args = ["--model", model] if model else []
    children = [await asyncio.create_subprocess_exec(*python, "coordinator", env=env | {_PORT_ENV: str(ports[0])})]
    children += [
        await asyncio.create_subprocess_exec(*python, "engine", *engine_args, env=env | {_PORT_ENV: str(port)})
        for port in ports[1:]
    ]

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    coordinator_exit = asyncio.ensure_future(children[0].wait())
    coordinator_exit.add_done_callback(lambda _: stop.set())
    try:
        client = await _wait_for_coordinator(settings)
        await client.close()
        await _wait_for_engines(settings, client.coordinator_id, engines)
        prefix = settings.subject_prefix
        sys.stdout.write(
            f"dpcoord is up: coordinator + {engines} {settings.backend} engine(s)\n"
            f"NATS: {settings.nats_url}\n"
            f"Submit: dpcoord submit 'Hello' --stream --nats-url {settings.nats_url}\n"
            f"   or: nats request -s {settings.nats_url} {prefix}.submit_request '{{\"prompt\": \"Hello\"}}'\n"
            f"{_http_lines(ports)}"
            "Ctrl-C stops everything.\n"
        )
        sys.stdout.flush()
        await stop.wait()
    finally:
        for child in children:
            if child.returncode is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                await asyncio.wait_for(child.wait(), 15)
            except TimeoutError:
                child.kill()
                await child.wait()
        if server is not None:
            server.stop()
    return 0
