"""``dpcoord up``: an embedded nats-server with JetStream in a temporary store (unless a NATS
URL is given), one coordinator, N engines and the OpenAI-compatible HTTP gateway (unless
``--no-gateway``) as child processes, stopped together on Ctrl-C or SIGTERM.

The parts are supervised (service/cli/supervise.py): when any of them exits, during start or
later, ``up`` names it with its exit code, its last log lines and a fix when it knows one (the
``gateway`` extra missing, the gateway's port taken), stops the rest and exits 1; a part asked
to stop (``dpcoord control stop``) ends the stack with exit 0. Without the gateway extra
installed it says so before starting anything; a NATS URL that cannot be reached is named
within the connect timeout, before anything starts.

While engines load, ``up`` says every few seconds how many registered so far (each engine logs
how far its weights loaded). The banner prints once every part serves: every engine registered
with the coordinator, the coordinator's ``/readyz`` answering 200 (it has joined the
arbitration of request ids), and the gateway listening (its own log says so) with its
``/readyz`` answering 200. The gateway's
port is 8000 when the gateway could bind it: the check binds as the gateway does
(``SO_REUSEADDR``), so connections in TIME_WAIT from a previous run do not make it look taken."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

from service.bus.connection import NatsUnreachable, close_nats, connect_nats
from service.bus.server import EmbeddedNatsServer, free_port
from service.cli.fleet_commands import coordinator_status
from service.cli.supervise import GATEWAY_EXTRA_HINT, Parts
from service.client import ClientError, DpcoordClient
from service.ops.children import die_with_parent
from service.ops.setting_groups import SettingGroup
from service.ops.settings import Settings, settings_in

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


async def _registered_engines(client: DpcoordClient) -> int | None:
    """How many engines the coordinator knows; None while its status endpoint is not up yet."""
    status = await coordinator_status(client)
    return None if status is None else len(status.engines)


UP_WAIT_LINE_S = 5.0  # how often up says it still waits for engines (their own logs say how far they loaded)


async def until_ready(settings: Settings, engines: int, line_every_s: float = UP_WAIT_LINE_S) -> int:
    """Wait for the coordinator, then until every engine has registered (a model takes a while to
    load; an engine that exits instead ends the stack, see :class:`Parts`), saying so on stderr
    every ``line_every_s``; returns how many did."""
    client = await _wait_for_coordinator(settings)
    loop = asyncio.get_running_loop()
    started = loop.time()
    next_line = started + line_every_s
    try:
        while True:
            registered = await _registered_engines(client)
            if registered is not None and registered >= engines:
                return registered
            if loop.time() >= next_line:
                next_line += line_every_s
                sys.stderr.write(
                    f"dpcoord up: waiting for the engines to load and register: {registered or 0} of {engines} "
                    f"so far ({loop.time() - started:.0f} s)\n"
                )
                sys.stderr.flush()
            await asyncio.sleep(0.1)
    finally:
        await client.close()


def dpcoord_command() -> str:
    """How a shell in this directory runs this dpcoord: ``dpcoord`` when that name on PATH is this
    installation, else the script's path (``.venv/bin/dpcoord`` after ``make up``)."""
    script = Path(sys.executable).parent / "dpcoord"
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m service"
    on_path = shutil.which("dpcoord")
    if on_path is not None and os.path.samefile(on_path, script):
        return "dpcoord"
    if script.is_relative_to(Path.cwd()):
        return shlex.quote(str(script.relative_to(Path.cwd())))
    return shlex.quote(str(script))


_SECRETS = ("nats_password", "nats_token")


def _connection_flags(settings: Settings) -> str:
    """The flags a client in another terminal needs to reach this stack: the NATS settings it was
    given, secrets as references to their environment variables rather than in clear."""
    flags = []
    for name, field in settings_in((SettingGroup.NATS,)).items():
        value = getattr(settings, name)
        if name not in settings.model_fields_set or value in (None, field.default):
            continue
        shown = f'"$DPCOORD_{name.upper()}"' if name in _SECRETS else shlex.quote(str(value))
        flags.append(f" --{name.replace('_', '-')} {shown}")
    return "".join(flags)


def _model_line(settings: Settings, model: str | None, dpcoord: str) -> str:
    if settings.backend == "echo":
        return "Engines: the echo backend, a test double that repeats the prompt (no model)\n"
    if model is not None:
        return f"Model: {model}\n"
    return (
        f"Model: the built-in random model (seed {settings.model_seed}): its output is noise.\n"
        f"   Load a checkpoint (a local Hugging Face-format directory): {dpcoord} up --model /path/to/model\n"
    )


GATEWAY_PORT = 8000  # the gateway's port when it is free and --gateway-port is not given
READY_TIMEOUT_S = 30.0
GATEWAY_LISTENING = "gateway on http://"  # what the gateway logs once it listens (service/gateway/server.py)


def gateway_port(settings: Settings, host: str) -> int:
    """--gateway-port when given, else 8000 when the gateway could listen on it on ``host``, else a
    free port. The check listens as the gateway will (its own ``listener``, with
    ``SO_REUSEADDR``, as uvicorn and asyncio bind), so a port whose last connections are in
    TIME_WAIT is free, as it is for the gateway."""
    from service.gateway.server import listener  # the gateway extra: checked present by run_stack

    if "gateway_port" in settings.model_fields_set:
        return settings.gateway_port
    try:
        listener(host, GATEWAY_PORT, reuse_port=False).close()
    except OSError as exc:
        port = free_port()
        log.warning(
            "port %d is taken on %s (%s): the gateway takes port %d (--gateway-port chooses)",
            GATEWAY_PORT,
            host,
            exc.strerror,
            port,
        )
        return port
    return GATEWAY_PORT


async def _http_status(host: str, port: int, path: str) -> int | None:
    """The status of one GET, or None when nothing answers."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return None
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        status_line = await reader.readline()
    except OSError:
        return None
    finally:
        writer.close()
    parts = status_line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


class StackNotUp(Exception):
    """A part that runs but does not serve: ``up`` stops the stack and says which (exit 1)."""


async def _until_http_ready(part: str, host: str, port: int) -> None:
    """Until ``part``'s /readyz answers 200 (a coordinator among peers joins their arbitration
    first), or StackNotUp after READY_TIMEOUT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    while (status := await _http_status(host, port, "/readyz")) != 200:
        if loop.time() > deadline:
            answer = "nothing answered" if status is None else f"the last answer was {status}"
            raise StackNotUp(
                f"{part} on http://{host}:{port} is not ready after {READY_TIMEOUT_S:.0f} s "
                f"(/readyz: {answer}); its log above says why"
            )
        await asyncio.sleep(0.1)


async def _gateway_lines(settings: Settings, host: str, port: int) -> str:
    """The banner's lines for the gateway, once its /readyz says a model is served."""
    await _until_http_ready("the gateway", host, port)
    async with await _wait_for_coordinator(settings) as client:
        models = [served.name for served in (await client.list_models()).models]
    url = f"http://{host}:{port}"
    body = json.dumps({"model": models[0] if models else "MODEL", "prompt": "Hello", "max_tokens": 16})
    return (
        f"OpenAI API: {url}/v1 (models: {', '.join(models) or 'none yet'})\n"
        f"   curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
    )


def _banner(settings: Settings, model: str | None, registered: int, ports: list[int], gateway_lines: str = "") -> str:
    dpcoord = dpcoord_command()
    return (
        f"dpcoord is up: coordinator + {registered} {settings.backend} engine(s)\n"
        f"{_model_line(settings, model, dpcoord)}"
        f"NATS: {settings.nats_url}\n"
        f"Submit: {dpcoord} submit 'Hello' --stream{_connection_flags(settings)}\n"
        f'   or: nats request -s {settings.nats_url} {settings.subject_prefix}.submit_request \'{{"prompt": "Hello"}}\'\n'
        f"{gateway_lines}"
        f"{_http_lines(ports)}"
        "Ctrl-C stops everything.\n"
    )


# Settings `up` gives its children unless set: the gateway drains briefly (Ctrl-C stops everything
# within seconds), and health and metrics listen on the loopback, as NATS and the gateway do.
UP_DEFAULTS = {"gateway_drain_s": "2", "http_host": "127.0.0.1"}
GATEWAY_MODULES = ("starlette", "uvicorn", "httptools")


def missing_gateway_modules() -> list[str]:
    return [name for name in GATEWAY_MODULES if importlib.util.find_spec(name) is None]


async def run_stack(settings: Settings, engines: int, model: str | None, gateway: bool = True) -> int:
    """Run the stack until Ctrl-C or SIGTERM (exit 0), until a part is asked to stop (exit 0), or
    until any part fails (exit 1, naming it)."""
    missing = missing_gateway_modules() if gateway else []
    if missing:
        sys.stderr.write(
            f"dpcoord up: the gateway cannot start: {', '.join(missing)} not installed.\n{GATEWAY_EXTRA_HINT}\n"
        )
        return 1
    server: EmbeddedNatsServer | None = None
    if "nats_url" not in settings.model_fields_set:
        try:
            server = EmbeddedNatsServer(preexec_fn=die_with_parent).start()
        except (RuntimeError, OSError) as exc:
            sys.stderr.write(f"dpcoord up: the embedded nats-server did not start: {exc}\n")
            return 1
        settings = settings.model_copy(update={"nats_url": server.url})
        settings.model_fields_set.add("nats_url")
    else:
        try:
            await close_nats(await connect_nats(settings, "dpcoord-up", give_up=True))
        except NatsUnreachable as exc:
            sys.stderr.write(f"dpcoord up: {exc}\n")
            return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    parts = Parts()
    try:
        if server is not None:
            parts.watch_nats(server)
        return await _supervise(settings, engines, model, gateway, parts, stop)
    finally:
        await parts.stop()
        if server is not None:
            server.close()


async def _supervise(
    settings: Settings, engines: int, model: str | None, gateway: bool, parts: Parts, stop: asyncio.Event
) -> int:
    env = _child_env(settings)
    for name, value in UP_DEFAULTS.items():
        if name not in settings.model_fields_set:
            env[f"DPCOORD_{name.upper()}"] = value
    if "cpu_threads" not in settings.model_fields_set:
        # Engines sharing one machine's cores must not each start a thread per core.
        env["DPCOORD_CPU_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(engines, 1)))
    ports = http_ports(settings, engines)
    python = [sys.executable, "-m", "service"]
    engine_args = ["--model", model] if model else []
    await parts.start("coordinator", [*python, "coordinator"], env | {_PORT_ENV: str(ports[0])})
    for rank, port in enumerate(ports[1:]):
        await parts.start(f"engine {rank}", [*python, "engine", *engine_args], env | {_PORT_ENV: str(port)})
    gateway_host = settings.gateway_host if "gateway_host" in settings.model_fields_set else "127.0.0.1"
    gateway_address = ("127.0.0.1" if gateway_host == "0.0.0.0" else gateway_host, 0)
    gateway_listens: asyncio.Future[str] | None = None
    if gateway:
        gateway_address = (gateway_address[0], gateway_port(settings, gateway_host))
        gateway_env = env | {"DPCOORD_GATEWAY_HOST": gateway_host, "DPCOORD_GATEWAY_PORT": str(gateway_address[1])}
        gateway_listens = (await parts.start("gateway", [*python, "gateway"], gateway_env)).logged(GATEWAY_LISTENING)

    async def start_up() -> None:
        registered = await until_ready(settings, engines)
        await _until_http_ready("the coordinator", "127.0.0.1", ports[0])
        lines = ""
        if gateway_listens is not None:
            await gateway_listens
            lines = await _gateway_lines(settings, *gateway_address)
        if not parts.exited.done():
            sys.stdout.write(_banner(settings, model, registered, ports, lines))
            sys.stdout.flush()

    stopping = asyncio.ensure_future(stop.wait())
    starting = asyncio.ensure_future(start_up())
    try:
        await asyncio.wait((starting, stopping, parts.exited), return_when=asyncio.FIRST_COMPLETED)
        if starting.done() and starting.exception() is not None and not parts.exited.done():
            sys.stderr.write(f"dpcoord up: the stack did not come up: {starting.exception()}\n")
            return 1
        if starting.done():
            await asyncio.wait((stopping, parts.exited), return_when=asyncio.FIRST_COMPLETED)
        if parts.exited.done() and not stop.is_set():
            ended = parts.exited.result()
            sys.stderr.write(ended.report())
            return 0 if ended.asked else 1
        return 0
    finally:
        for task in (starting, stopping):
            task.cancel()
        await asyncio.gather(starting, stopping, return_exceptions=True)
