"""The gateway's ASGI plumbing, without a web framework on the request path.

A route is a path and, per method, a handler ``(scope, receive, send) -> None``; a path is looked
up in a dict. What no route serves is answered in OpenAI's error shape: 404 for an unknown path,
405 (with ``Allow``) for a method the path does not serve. Bodies are read only after a handler
decided to read them (so an API key is checked first), bounded in bytes (and in time by the
HTTP edge, service/gateway/edge.py), and only
JSON (``Content-Type: application/json``, or none at all) is read: anything else is 415.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from service.gateway.errors import GatewayError

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON = b"application/json"
TEXT = b"text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    methods: dict[str, Handler]

    @property
    def allow(self) -> str:
        return ", ".join(sorted(self.methods))


class Routes:
    """Exact paths, plus one prefix route whose handler reads the rest of the path."""

    def __init__(self, routes: Iterable[Route], prefix: Route | None = None) -> None:
        self._routes = {route.path: route for route in routes}
        self._prefix = prefix

    def handler(self, scope: Scope) -> Handler:
        path: str = scope["path"]
        route = self._routes.get(path)
        if route is None and self._prefix is not None and path.startswith(self._prefix.path):
            route = self._prefix
        if route is None:
            raise GatewayError(404, f"Invalid URL ({scope['method']} {path})", code="unknown_url")
        handler = route.methods.get(scope["method"])
        if handler is None:
            raise GatewayError(
                405,
                f"Method {scope['method']} is not allowed on {path}; allowed: {route.allow}",
                code="method_not_allowed",
                headers={"Allow": route.allow},
            )
        return handler


def header(scope: Scope, name: bytes) -> bytes | None:
    """One request header (names are lower-case in ASGI), the first of its name."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def respond(
    send: Send, status: int, body: bytes, content_type: bytes = JSON, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def respond_error(send: Send, err: GatewayError) -> None:
    headers = [(name.lower().encode(), value.encode()) for name, value in err.headers().items()]
    await respond(send, err.status, err.body(), JSON, headers)


def check_json(scope: Scope) -> None:
    """415 unless the body is declared JSON (``application/json`` or ``*/*+json``) or not declared."""
    declared = header(scope, b"content-type")
    if declared is None:
        return
    media = declared.split(b";", 1)[0].strip().lower()
    if media != JSON and not (media.startswith(b"application/") and media.endswith(b"+json")):
        shown = media.decode("latin-1")[:100]
        raise GatewayError(415, f"the body must be JSON (Content-Type: application/json), not {shown}", "content-type")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes before it is all read. How long it may take
    to arrive is the HTTP edge's bound (service/gateway/edge.py: 408, then the connection goes)."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        body: bytes = message.get("body", b"")  # the common case: one piece
        if len(body) > limit:
            raise too_large(len(body), limit)
        return body
    parts = bytearray()
    while True:
        if message["type"] != "http.request":
            raise GatewayError(400, "the client left before sending the whole body")
        parts += message.get("body", b"")
        if len(parts) > limit:
            raise too_large(len(parts), limit)
        if not message.get("more_body", False):
            return bytes(parts)
        message = await receive()


def too_large(size: int, limit: int) -> GatewayError:
    return GatewayError(413, f"request body of {size} bytes exceeds the {limit}-byte limit", code="payload_too_large")
