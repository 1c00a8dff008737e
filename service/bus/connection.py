"""One way to connect to NATS: auth and TLS from settings, unbounded reconnect with logging.

Settings choose at most one authentication method (user and password, token, nkey seed file,
or creds file; see docs/security.md). TLS is used whenever the server requires it; the CA,
client certificate and key, the expected server name and handshake-first come from settings.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from service.bus.direct import DirectClient


class ConnectionSettings(Protocol):
    """The connection settings this module reads; ``service.ops.settings.Settings`` has them all."""

    @property
    def nats_url(self) -> str: ...
    @property
    def nats_user(self) -> str | None: ...
    @property
    def nats_password(self) -> str | None: ...
    @property
    def nats_token(self) -> str | None: ...
    @property
    def nats_nkey_seed_file(self) -> str | None: ...
    @property
    def nats_creds_file(self) -> str | None: ...
    @property
    def nats_tls_ca_file(self) -> str | None: ...
    @property
    def nats_tls_cert_file(self) -> str | None: ...
    @property
    def nats_tls_key_file(self) -> str | None: ...
    @property
    def nats_tls_hostname(self) -> str | None: ...
    @property
    def nats_tls_handshake_first(self) -> bool: ...
    @property
    def nats_inbox_prefix(self) -> str: ...
    @property
    def nats_connect_timeout_s(self) -> float: ...


log = logging.getLogger(__name__)


def _tls_context(settings: ConnectionSettings) -> ssl.SSLContext | None:
    """A context for the CA and client certificate in settings; None leaves nats-py's default
    (the system CAs), which it uses when the server requires TLS."""
    if not (settings.nats_tls_ca_file or settings.nats_tls_cert_file):
        return None
    context = ssl.create_default_context(cafile=settings.nats_tls_ca_file)
    if settings.nats_tls_cert_file:
        context.load_cert_chain(settings.nats_tls_cert_file, settings.nats_tls_key_file)
    return context


ConnectionEvent = Callable[[], None]
ErrorListener = Callable[[Exception], Awaitable[None]]


def connect_options(
    settings: ConnectionSettings,
    name: str,
    nc: NATS,
    on_disconnect: ConnectionEvent | None,
    on_reconnect: ConnectionEvent | None,
    *,
    on_error: ErrorListener | None = None,
) -> dict[str, Any]:
    """nats-py connect options; ``on_error`` also hears every asynchronous error, such as a
    permissions violation, after it is logged."""

    async def on_nats_error(exc: Exception) -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats error (%s): %s", name, exc)
        if on_error is not None:
            await on_error(exc)

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
        "inbox_prefix": settings.nats_inbox_prefix,
        "error_cb": on_nats_error,
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
    if settings.nats_tls_hostname:
        options["tls_hostname"] = settings.nats_tls_hostname
    if settings.nats_tls_handshake_first:
        options["tls_handshake_first"] = True
    return options


async def connect_nats(
    settings: ConnectionSettings,
    name: str,
    on_disconnect: ConnectionEvent | None = None,
    on_reconnect: ConnectionEvent | None = None,
    *,
    on_error: ErrorListener | None = None,
    nc: DirectClient | None = None,
) -> DirectClient:
    """Connect ``nc`` (a new client when None) with unbounded reconnects; the optional
    callbacks run on each disconnect, reconnect and asynchronous error."""
    nc = nc or DirectClient()
    await nc.connect(**connect_options(settings, name, nc, on_disconnect, on_reconnect, on_error=on_error))
    return nc


async def flush_subscriptions(nc: NATS) -> None:
    """Return once the server has every subscription this connection made so far.

    nats-py (2.16) writes ``flush()``'s PING straight to the socket, ahead of commands still
    buffered for its flusher task, so a single flush can return before the server has seen
    subscriptions made just before it; a message published from another connection in that
    window is lost. While the first flush waits, the flusher writes the buffered commands,
    so the second PING follows them on the wire.
    """
    await nc.flush()
    await nc.flush()


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
