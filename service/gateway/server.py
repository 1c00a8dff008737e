"""``dpcoord gateway``: the gateway's ASGI app under uvicorn, with httptools parsing HTTP and the
event loop the settings choose (uvloop when installed). SIGINT and SIGTERM stop it as they stop
the other dpcoord processes: uvicorn stops accepting, lets requests in progress finish, the app
closes its NATS connection, and the process exits 0 (uvicorn's own handlers would re-raise the
signal and exit with it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator

import uvicorn

from service.gateway.app import Gateway
from service.gateway.auth import ApiKeys
from service.ops.settings import Settings

log = logging.getLogger(__name__)

# Seconds an idle keep-alive connection is kept: load generators and SDKs reuse connections.
KEEP_ALIVE_S = 30
# Seconds requests in progress get to finish on shutdown.
GRACEFUL_SHUTDOWN_S = 10


def uvicorn_config(gateway: Gateway, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        gateway.app,
        host=settings.gateway_host,
        port=settings.gateway_port,
        loop="none",  # the caller's loop: service.ops.event_loop picks uvloop or asyncio
        http="httptools",
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # X-Forwarded-* change nothing the gateway does
        log_config=None,  # dpcoord's logging configuration stays in force
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: :func:`serve` installs the loop's own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def serve(settings: Settings, api_keys: ApiKeys) -> int:
    gateway = Gateway(settings, api_keys)
    server = _Server(uvicorn_config(gateway, settings))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, setattr, server, "should_exit", True)
    log.info(
        "gateway on http://%s:%d (API keys %s)",
        settings.gateway_host,
        settings.gateway_port,
        "required" if api_keys.required else "not required",
    )
    await server.serve()
    return 0 if server.started else 1
