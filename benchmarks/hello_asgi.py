"""The bare baselines of ``dpcoord bench --gateway``, ASGI apps under the same server as the
gateway (uvicorn, httptools behind service/gateway/edge.py's bounds, the same event loop,
settings and garbage-collector settings, service/ops/gc_tuning.py):

- ``hello`` reads the body and answers a fixed completion-shaped JSON body. What the gateway
  spends per request beyond this is the gateway's own work: routing, validation, the client
  library and NATS.
- ``relay`` (``--relay``) does the same, with one request through the client library in
  between (``submit("Hello", max_tokens=16)``, its reply dropped): the least any gateway on this
  server and this client library spends per request. What the gateway spends beyond it is its
  OpenAI work: validation, translation, the response's JSON.

Run: ``python -m benchmarks.hello_asgi PORT [--relay]`` (the benchmark starts it).
"""

from __future__ import annotations

import sys
from typing import Any

import uvicorn

from service.client import DpcoordClient
from service.gateway.edge import edge_protocol
from service.gateway.server import edge_limits
from service.ops import event_loop, gc_tuning
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


class Relay:
    """``hello`` with a request through the client library before the answer."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._client: DpcoordClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                self._client = await DpcoordClient.connect(self._settings, client_id="bench-relay")
                await send({"type": "lifespan.startup.complete"})
            if self._client is not None:
                await self._client.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body", False):
            pass
        assert self._client is not None, "lifespan startup connects the client"
        await self._client.submit("Hello", model="dpcoord-echo", max_tokens=16)
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        await send({"type": "http.response.body", "body": BODY})


def main(port: int, relay: bool) -> None:
    settings = Settings()
    config = uvicorn.Config(
        Relay(settings) if relay else hello,
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
    server = uvicorn.Server(config)
    gc_tuning.tune_for_throughput()  # as the gateway does (service/gateway/server.py)
    event_loop.run(server.serve(), settings.event_loop)


if __name__ == "__main__":
    main(int(sys.argv[1]), "--relay" in sys.argv[2:])
