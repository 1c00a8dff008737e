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
    """Serves the probes and the metrics of one process; ``port`` 0 binds a free port."""

    def __init__(
        self,
        host: str,
        port: int,
        health: Callable[[], Check],
        ready: Callable[[], Check],
        registry: CollectorRegistry,
    ) -> None:
        self.host = host
        self.port = port
        self._health = health
        self._ready = ready
        self._registry = registry
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=_MAX_HEAD_BYTES)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot serve /healthz, /readyz and /metrics on {self.host}:{self.port} ({exc.strerror}); "
                "choose another --http-port (DPCOORD_HTTP_PORT), or 0 to turn them off",
            ) from exc
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("health and metrics on http://%s:%d (%s, %s, %s)", self.host, self.port, HEALTH_PATH, READY_PATH, METRICS_PATH)

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
