"""One way to connect to NATS: auth and TLS from settings, unbounded reconnect with logging.

Settings choose at most one authentication method (user and password, token, nkey seed file,
or creds file; see docs/security.md). TLS is used whenever the server requires it; the CA,
client certificate and key, the expected server name and handshake-first come from settings.

The first connection: a service (coordinator, engine) retries until a server answers, since
it may start before NATS does; a client that someone waits on (the client library, the CLI)
gives up (``give_up=True``) after ``nats_connect_timeout_s`` per server in ``nats_url`` with
:class:`NatsUnreachable`, one error naming the URL and the last failure, its attempts logged
at debug level only.

Leaving: :func:`close_nats` drains when it can and never raises, and :func:`unless_lost`
bounds any other goodbye to the server (a service's unsubscriptions): when NATS goes away in
the middle, the step is given up (nats-py would wait out its 10 s flush timeout and raise), so
a process told to stop while NATS is going away still stops at once and cleanly.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

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
        "servers": server_urls(settings.nats_url),
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


class NatsUnreachable(ConnectionError):
    """No NATS server in ``nats_url`` accepted a connection within the time given to the first one."""


def server_urls(nats_url: str) -> list[str]:
    return [url.strip() for url in nats_url.split(",") if url.strip()]


def shown_url(nats_url: str) -> str:
    """``nats_url`` without user names, passwords or tokens, fit for an error message."""
    shown = []
    for url in server_urls(nats_url):
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        shown.append(f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}")
    return ",".join(shown)


async def connect_nats(
    settings: ConnectionSettings,
    name: str,
    on_disconnect: ConnectionEvent | None = None,
    on_reconnect: ConnectionEvent | None = None,
    *,
    on_error: ErrorListener | None = None,
    nc: DirectClient | None = None,
    give_up: bool = False,
) -> DirectClient:
    """Connect ``nc`` (a new client when None) with unbounded reconnects; the optional
    callbacks run on each disconnect, reconnect and asynchronous error. The first connection
    is retried until a server answers, or with ``give_up`` for ``nats_connect_timeout_s`` per
    server in ``nats_url``, then :class:`NatsUnreachable`."""
    nc = nc or DirectClient()
    options = connect_options(settings, name, nc, on_disconnect, on_reconnect, on_error=on_error)
    if not give_up:
        await nc.connect(**options)
        return nc
    on_nats_error = options["error_cb"]
    connected = False

    async def quiet_until_connected(exc: Exception) -> None:
        """A failed attempt of the first connection is for the debug log: the error raised names the last one."""
        if connected:
            await on_nats_error(exc)
        else:
            log.debug("nats connect attempt failed (%s): %s", name, exc)

    options["error_cb"] = quiet_until_connected
    budget_s = settings.nats_connect_timeout_s * len(options["servers"])
    try:
        await asyncio.wait_for(nc.connect(**options), budget_s)
        connected = True
    except TimeoutError:
        last = nc.last_error
        await close_nats(nc)
        raise NatsUnreachable(
            f"cannot connect to NATS at {shown_url(settings.nats_url)} within {budget_s:g} s"
            f"{f' ({last})' if last else ''}; is a server running there? (--nats-url, DPCOORD_NATS_URL)"
        ) from None
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


LOSS_POLL_S = 0.05  # how often a goodbye to the server checks whether the connection is lost
LOSS_GRACE_S = 0.5  # how long it may still take once the connection is gone (a drain closing it)


async def unless_lost(nc: NATS, goodbye: Awaitable[object], what: str) -> bool:
    """Await ``goodbye``, a step that talks to the server on the way out, unless the connection
    is or gets lost (reconnecting or closed) first: then, after a short grace, it is given up.
    Never raises a NATS or socket error (it is logged); returns whether the step completed."""
    step = asyncio.ensure_future(goodbye)
    try:
        while not step.done() and nc.is_connected:
            await asyncio.wait((step,), timeout=LOSS_POLL_S)
        if not step.done():
            await asyncio.wait((step,), timeout=LOSS_GRACE_S)
    except asyncio.CancelledError:
        step.cancel()
        raise
    if not step.done():
        step.cancel()
        await asyncio.gather(step, return_exceptions=True)
        log.info("%s given up: the NATS connection is gone", what)
        return False
    error = step.exception()
    if error is None:
        return True
    if not isinstance(error, NatsError | OSError | RuntimeError):  # RuntimeError: uvloop's closed transport
        raise error
    log.info("%s given up: %s", what, error or type(error).__name__)
    return False


async def close_nats(nc: NATS) -> None:
    """Drain when connected (flushes what is pending), else close, and never raise: a
    connection that is reconnecting, or breaks while draining, can only be closed.

    A round trip comes first: nats-py's drain, cut once NATS is gone, would leave an internal
    future whose exception nobody reads (asyncio logs it with a traceback), so the drain starts
    only on a connection that just answered; a round trip is cut cleanly."""
    if nc.is_closed:
        return
    if (
        nc.is_connected
        and await unless_lost(nc, nc.flush(), "flushing the NATS connection")
        and await unless_lost(nc, nc.drain(), "draining the NATS connection")
    ):
        return
    if nc.is_closed:
        return
    try:
        await nc.close()
    except (NatsError, OSError, RuntimeError) as exc:  # RuntimeError: uvloop's transport already closed
        log.info("nats connection closed uncleanly: %s", exc or type(exc).__name__)
