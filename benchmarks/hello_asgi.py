"""The bare baseline of ``dpcoord bench --gateway``: an ASGI "hello" app under the same server as
the gateway (uvicorn, httptools behind service/gateway/edge.py's bounds, the same event loop and
settings), which reads the body and answers a fixed completion-shaped JSON body. What the gateway
spends per request beyond this is the gateway's own work: routing, validation, the client
library and NATS.

Run: ``python -m benchmarks.hello_asgi PORT`` (the benchmark starts it).
"""

from __future__ import annotations

import sys
from typing import Any

import uvicorn

from service.gateway.edge import edge_protocol
from service.gateway.server import edge_limits
from service.ops import event_loop
from service.ops.settings import Settings

BODY = (
    b'{"id":"cmpl-0","created":0,"model":"dpcoord-echo","choices":[{"index":0,"text":"HelloHelloHelloH",'
    b'"finish_reason":"length","logprobs":null}],"usage":{"prompt_tokens":5,"completion_tokens":16,'
    b'"total_tokens":21},"object":"text_completion"}'
)
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


def main(port: int) -> None:
    settings = Settings()
    config = uvicorn.Config(
        hello,
        host="127.0.0.1",
        port=port,
        loop="none",
        http=edge_protocol(edge_limits(settings)),
        lifespan="on",
        access_log=False,
        proxy_headers=False,
        log_config=None,
        timeout_keep_alive=int(settings.gateway_idle_timeout_s),
    )
    event_loop.run(uvicorn.Server(config).serve(), settings.event_loop)


if __name__ == "__main__":
    main(int(sys.argv[1]))
