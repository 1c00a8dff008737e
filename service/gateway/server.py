"""``dpcoord gateway``: the gateway's ASGI app under uvicorn, with httptools parsing HTTP behind the
bounds of service/gateway/edge.py, on the event loop the settings choose (uvloop when installed).

SIGINT and SIGTERM start a drain (:func:`drain`), in two steps:

1. While generation requests are in progress, for at most ``gateway_drain_s``: the socket keeps
   listening, so a load balancer's or kubelet's probe still gets an answer, and ``/readyz`` and
   ``/health`` answer 503 (``/healthz`` stays 200: the process is alive); a new generation
   request is answered 503 ``shutting_down``; every response closes its connection, and idle
   keep-alive connections are closed at once. The requests still running at the deadline are
   cut (service/gateway/generation.py): a stream ends with an error event and ``[DONE]``, a
   request not yet answered gets a 503 ``shutting_down`` error body.
2. Then uvicorn shuts down: the listening socket closes (a new connection is refused from here
   on), the app closes its NATS connection, and the process exits 0. A drain with nothing in
   progress goes to this step at once.

``gateway_workers`` > 1 runs that many processes on one port: this one and ``N - 1`` workers it
starts, each with its own socket bound with ``SO_REUSEPORT`` (the kernel spreads connections over
them) and its own NATS connection. A worker gets its settings on standard input, so no secret is
on its command line, dies with this process (``PR_SET_PDEATHSIG``), and is stopped with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable, Generator

import uvicorn

from service.gateway.app import Gateway
from service.gateway.auth import ApiKeys
from service.gateway.edge import EdgeLimits, edge_protocol
from service.ops import event_loop, gc_tuning
from service.ops.children import die_with_parent
from service.ops.settings import Settings

log = logging.getLogger(__name__)

# Seconds the requests a drain cut get to write their last words and abort their submissions.
CUT_GRACE_S = 2.0
# Seconds uvicorn's own shutdown, after the drain, gives what still runs then (probes answer at
# once while draining). Under `dpcoord up` (a 2 s drain) the worst case stays near its 5 s stop.
SHUTDOWN_GRACE_S = 1
WORKER_ENTRY = "from service.gateway.server import worker_main; raise SystemExit(worker_main())"


def edge_limits(settings: Settings) -> EdgeLimits:
    return EdgeLimits(
        max_header_bytes=settings.gateway_max_header_bytes,
        max_headers=settings.gateway_max_headers,
        read_timeout_s=settings.gateway_read_timeout_s,
        max_connections=settings.gateway_max_connections,
        write_stall_s=2 * settings.gateway_stream_stall_s,
    )


def uvicorn_config(gateway: Gateway, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        gateway,
        host=settings.gateway_host,
        port=settings.gateway_port,
        loop="none",  # the caller's loop: service.ops.event_loop picks uvloop or asyncio
        http=edge_protocol(edge_limits(settings), lambda: gateway.draining),
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # X-Forwarded-* change nothing the gateway does
        log_config=None,  # dpcoord's logging configuration stays in force
        timeout_keep_alive=int(max(1, settings.gateway_idle_timeout_s)),
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,  # after drain(), which waits gateway_drain_s
    )


def listener(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: :func:`serve` installs the loop's own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def drain(gateway: Gateway, server: uvicorn.Server, drain_s: float) -> None:
    """Fail readiness and refuse new work while the requests in progress finish, cut those still
    running after ``drain_s``, then let uvicorn shut down (module docstring)."""
    gateway.draining = True
    requests = gateway.requests
    for connection in list(server.server_state.connections):
        connection.shutdown()  # uvicorn's: closes it if idle, else after its response
    log.info("gateway draining: %d request(s) in progress get %.0f s to finish", len(requests), drain_s)
    try:
        await asyncio.wait_for(requests.idle(), drain_s)
    except TimeoutError:
        log.warning("gateway drain: cut %d request(s) still running after %.0f s", requests.cut(), drain_s)
        try:
            await asyncio.wait_for(requests.idle(), CUT_GRACE_S)
        except TimeoutError:
            log.warning("gateway drain: %d cut request(s) did not end within %.0f s", len(requests), CUT_GRACE_S)
    server.should_exit = True


async def serve_on(
    settings: Settings, api_keys: ApiKeys, sock: socket.socket, on_signal: Callable[[], None] | None = None
) -> bool:
    """Serve on ``sock`` until a signal drains this process (and calls ``on_signal``); whether
    uvicorn started."""
    gateway = Gateway(settings, api_keys)
    server = _Server(uvicorn_config(gateway, settings))
    gc_tuning.tune_for_throughput()
    draining: list[asyncio.Task[None]] = []  # the one drain, once signalled

    def signalled() -> None:
        if draining:
            return
        draining.append(asyncio.ensure_future(drain(gateway, server, settings.gateway_drain_s)))
        if on_signal is not None:
            on_signal()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, signalled)
    await server.serve(sockets=[sock])
    return server.started


async def serve(settings: Settings, api_keys: ApiKeys) -> int:
    workers = settings.gateway_workers
    try:
        sock = listener(settings.gateway_host, settings.gateway_port, reuse_port=workers > 1)
    except OSError as exc:
        log.error("gateway: cannot listen on %s:%d: %s", settings.gateway_host, settings.gateway_port, exc)
        return 1
    port = sock.getsockname()[1]
    children = [
        await _start_worker(settings.model_copy(update={"gateway_port": port}), api_keys) for _ in range(1, workers)
    ]
    log.info(
        "gateway on http://%s:%d (%d process(es); API keys %s)",
        settings.gateway_host,
        port,
        workers,
        "required" if api_keys.required else "not required",
    )

    def stop_workers() -> None:  # they drain alongside this process, not after it
        for child in children:
            if child.returncode is None:
                child.send_signal(signal.SIGTERM)

    try:
        started = await serve_on(settings, api_keys, sock, stop_workers)
    finally:
        stop_workers()
        for child in children:
            await child.wait()
    return 0 if started else 1


async def _start_worker(settings: Settings, api_keys: ApiKeys) -> asyncio.subprocess.Process:
    setup = json.dumps({"settings": settings.model_dump(mode="json"), "keys": api_keys.digests()}).encode()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WORKER_ENTRY, stdin=asyncio.subprocess.PIPE, preexec_fn=die_with_parent
    )
    if child.stdin is None:
        raise RuntimeError("the worker's standard input is not a pipe")
    child.stdin.write(setup)
    await child.stdin.drain()
    child.stdin.close()
    return child


def worker_main() -> int:
    """A worker process: settings and key digests from standard input, then :func:`serve_on`
    on its own ``SO_REUSEPORT`` socket."""
    setup = json.loads(sys.stdin.buffer.read())
    settings = Settings(**{**setup["settings"], "gateway_workers": 1})
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    sock = listener(settings.gateway_host, settings.gateway_port, reuse_port=True)
    started = event_loop.run(serve_on(settings, ApiKeys.from_digests(setup["keys"]), sock), settings.event_loop)
    return 0 if started else 1
