"""One way to connect to NATS: auth and TLS from settings, unbounded reconnect with logging."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from service.settings import Settings

log = logging.getLogger(__name__)


def _tls_context(settings: Settings) -> ssl.SSLContext | None:
    if not (settings.nats_tls_ca_file or settings.nats_tls_cert_file):
        return None
    context = ssl.create_default_context(cafile=settings.nats_tls_ca_file)
    if settings.nats_tls_cert_file:
        context.load_cert_chain(settings.nats_tls_cert_file, settings.nats_tls_key_file)
    return context


ConnectionEvent = Callable[[], None]


def connect_options(
    settings: Settings, name: str, nc: NATS, on_disconnect: ConnectionEvent | None, on_reconnect: ConnectionEvent | None
) -> dict[str, Any]:
    async def on_error(exc: Exception) -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats error (%s): %s", name, exc)

    async def on_disconnected() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats disconnected (%s); reconnecting", name)
            if on_disconnect is not None:
                on_disconnect()

    async def on_reconnected() -> None:
        log.info("nats reconnected (%s) to %s", name, nc.connected_url.netloc if nc.connected_url else "?")
        if on_reconnect is not None:
            on_reconnect()

    options: dict[str, Any] = {
        "servers": [url.strip() for url in settings.nats_url.split(",") if url.strip()],
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": settings.nats_connect_timeout_s,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
    }
    if settings.nats_user:
        options["user"] = settings.nats_user
        options["password"] = settings.nats_password
    if settings.nats_token:
        options["token"] = settings.nats_token
    if settings.nats_nkey_seed_file:
        options["nkeys_seed"] = settings.nats_nkey_seed_file
    if settings.nats_creds_file:
        options["user_credentials"] = settings.nats_creds_file
    tls = _tls_context(settings)
    if tls is not None:
        options["tls"] = tls
    return options


async def connect_nats(
    settings: Settings,
    name: str,
    on_disconnect: ConnectionEvent | None = None,
    on_reconnect: ConnectionEvent | None = None,
) -> NATS:
    """Connect with unbounded reconnects; the optional callbacks run on each disconnect/reconnect."""
    nc = NATS()
    await nc.connect(**connect_options(settings, name, nc, on_disconnect, on_reconnect))
    return nc


async def close_nats(nc: NATS) -> None:
    """Drain when connected (flushes what is pending); a connection that is reconnecting or
    breaks while draining can only be closed."""
    if nc.is_closed:
        return
    try:
        await nc.drain()
    except (NatsError, OSError) as exc:
        log.info("nats connection closed without draining: %s", exc)
        await nc.close()
