"""``/healthz``, ``/readyz`` and ``/metrics`` over a minimal HTTP/1.1 server.

Kubernetes probes and Prometheus scrapes need three GET routes and nothing else, so this is
``asyncio.start_server`` with one request per connection rather than a web framework. The
service decides what healthy and ready mean (``Check`` callables); this module only serves
them: 200 with the detail when the check passes, 503 when it does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
METRICS_PATH = "/metrics"
_MAX_HEAD_BYTES = 16 * 1024
_READ_TIMEOUT_S = 5.0
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


@dataclass(frozen=True, slots=True)
class Check:
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


class HttpEndpoints:
    """Serves the probes and the metrics of one process; ``port`` 0 binds a free port.

    A port the operator chose (``port_chosen``) is bound or the process fails. The default port,
    when it cannot be bound (another process on the host has it), falls back to a free port
    with a warning that names it: the endpoints are never why a process that could serve exits.
    """

    def __init__(
        self,
        host: str,
        port: int,
        health: Callable[[], Check],
        ready: Callable[[], Check],
        registry: CollectorRegistry,
        port_chosen: bool = True,
    ) -> None:
        self.host = host
        self.port = port
        self._port_chosen = port_chosen
        self._health = health
        self._ready = ready
        self._registry = registry
        self._server: asyncio.Server | None = None

    async def bind(self) -> None:
        """Take the port without answering on it yet; a process binds before it joins the fleet,
        so a chosen port it cannot have stops it before a coordinator counts on it."""
        await self._bound()

    async def start(self) -> None:
        """Bind (unless ``bind`` did) and answer requests."""
        await (await self._bound()).start_serving()
        log.info(
            "health and metrics on http://%s:%d (%s, %s, %s)",
            self.host,
            self.port,
            HEALTH_PATH,
            READY_PATH,
            METRICS_PATH,
        )

    async def _bound(self) -> asyncio.Server:
        if self._server is not None:
            return self._server
        try:
            server = await self._listen(self.port)
        except OSError as exc:
            if self._port_chosen:
                raise OSError(
                    exc.errno,
                    f"cannot serve {HEALTH_PATH}, {READY_PATH} and {METRICS_PATH} on {self.host}:{self.port} "
                    f"({_reason(exc)}); choose another --http-port (DPCOORD_HTTP_PORT), or 0 to turn them off",
                ) from exc
            server = await self._listen(0)
            log.warning(
                "default HTTP port %d is taken on %s (%s): serving %s, %s and %s on port %d instead; "
                "--http-port (DPCOORD_HTTP_PORT) chooses the port",
                self.port,
                self.host,
                _reason(exc),
                HEALTH_PATH,
                READY_PATH,
                METRICS_PATH,
                _port_of(server),
            )
        self._server = server
        self.port = _port_of(server)
        return server

    async def _listen(self, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._serve, self.host, port, limit=_MAX_HEAD_BYTES, start_serving=False)

    async def stop(self) -> None:
        """Stop listening; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    async def __aenter__(self) -> HttpEndpoints:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def respond(self, method: str, path: str) -> Response:
        if path not in (HEALTH_PATH, READY_PATH, METRICS_PATH):
            return Response(404, f"no route {path}; try {HEALTH_PATH}, {READY_PATH} or {METRICS_PATH}\n".encode())
        if method not in ("GET", "HEAD"):
            return Response(405, f"{method} not allowed; use GET\n".encode())
        if path == METRICS_PATH:
            return Response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)
        check = self._health() if path == HEALTH_PATH else self._ready()
        return Response(200 if check.ok else 503, f"{'ok' if check.ok else 'not ok'}: {check.detail}\n".encode())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            method, path = _request_line(head)
            response = self.respond(method, path) if method else Response(400, b"malformed request line\n")
            writer.write(_encode(response, head_only=method == "HEAD"))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError) as exc:
            log.debug("http connection dropped: %s", type(exc).__name__)
        except Exception:
            log.exception("http endpoint failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def _reason(exc: OSError) -> str:
    """``Address already in use`` rather than asyncio's sentence around it."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


def _port_of(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


def _request_line(head: bytes) -> tuple[str, str]:
    """``("GET", "/healthz")`` from ``GET /healthz?x=1 HTTP/1.1``; empty strings when malformed."""
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "", ""
    return parts[0], parts[1].split("?", 1)[0]


def _encode(response: Response, head_only: bool) -> bytes:
    headers = (
        f"HTTP/1.1 {response.status} {_REASONS[response.status]}\r\n"
        f"Content-Type: {response.content_type}\r\n"
        f"Content-Length: {len(response.body)}\r\n"
        + ("Allow: GET, HEAD\r\n" if response.status == 405 else "")
        + "Connection: close\r\n\r\n"
    )
    return headers.encode("latin-1") + (b"" if head_only else response.body)
