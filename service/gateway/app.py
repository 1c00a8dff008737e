"""The gateway's ASGI application: OpenAI's HTTP API in front of the fleet.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (service/gateway/generation.py),
``GET /v1/models`` and ``GET /v1/models/{id}``, and the probes, which need no API key:
``/healthz`` (connected to NATS), ``/readyz`` and ``/health`` (vLLM's name, which load tools
probe: the coordinator answers and some engine serves a model; both fail while draining) and
``/metrics`` (Prometheus). Any other path is a 404 and any other method a 405, in OpenAI's error
shape like every error here (service/gateway/errors.py).

The application is a plain ASGI callable over a dict of routes (service/gateway/asgi.py): no web
framework runs per request. The gateway imports the client library and layers 1-3 only: never the
coordinator, the handlers or the engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from nats.errors import Error as NatsError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.types import Receive, Scope, Send

from service.client import ClientError, DpcoordClient
from service.gateway.asgi import TEXT, Route, Routes, header, respond, respond_error
from service.gateway.auth import ApiKeys
from service.gateway.errors import GatewayError, from_wire
from service.gateway.generation import CHAT, COMPLETIONS, Generation, Requests
from service.gateway.metrics import GatewayMetrics
from service.gateway.schemas import ModelCard, ModelCards, json_encoder
from service.ops.log_limit import RateLimitedLog
from service.ops.settings import Settings
from service.ops.tracing import start_tracing
from service.protocol.errors import ErrorCode
from service.protocol.messages import ModelList

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer

log = logging.getLogger(__name__)

CONNECT_RETRY_MAX_S = 2.0
MODELS_PREFIX = "/v1/models/"


class Gateway:
    """Owns the client library connection; the instance is the ASGI application."""

    def __init__(self, settings: Settings, api_keys: ApiKeys, tracer: Tracer | None = None) -> None:
        """``tracer``: where the gateway's spans go, and its client library's; by default from
        settings (None: tracing off)."""
        self.settings = settings
        self._owns_tracer = tracer is None
        self.tracer = tracer if tracer is not None else start_tracing(settings, "dpcoord-gateway")
        self.api_keys = api_keys
        self.started = int(time.time())
        self.metrics = GatewayMetrics(lambda: self._client.nc if self._client is not None else None)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.metrics)
        self.connected = asyncio.Event()
        self.requests = Requests()
        self.draining = False  # set by the drain (service/gateway/server.py)
        self._client: DpcoordClient | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._refusal_log = RateLimitedLog(log)
        generate = {
            endpoint.name: Generation(
                endpoint,
                settings,
                self.metrics,
                lambda: self.client,
                self._authorize,
                self.requests,
                lambda: self.draining,
                self.tracer,
            )
            for endpoint in (COMPLETIONS, CHAT)
        }
        probes = ("GET", "HEAD")
        self._routes = Routes(
            [
                Route("/v1/completions", {"POST": generate[COMPLETIONS.name]}),
                Route("/v1/chat/completions", {"POST": generate[CHAT.name]}),
                Route("/v1/models", {"GET": self.models}),
                Route("/healthz", dict.fromkeys(probes, self.healthz)),
                Route("/readyz", dict.fromkeys(probes, self.readyz)),
                Route("/health", dict.fromkeys(probes, self.readyz)),
                Route("/metrics", dict.fromkeys(probes, self.prometheus)),
            ],
            prefix=Route(MODELS_PREFIX, {"GET": self.model}),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            try:
                handler = self._routes.handler(scope)
            except GatewayError as err:
                await respond_error(send, err)
                return
            await handler(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect in the background: the gateway serves its probes while the coordinator comes up."""
        self._connecting = asyncio.ensure_future(self._connect())

    async def stop(self) -> None:
        """Safe to call twice."""
        if self._connecting is not None:
            self._connecting.cancel()
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        if self.tracer is not None and self._owns_tracer:
            self._owns_tracer = False
            await asyncio.to_thread(self.tracer.close)  # exports what is left: off the event loop

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _connect(self) -> None:
        delay = 0.1
        client_id = f"gateway-{uuid.uuid4().hex[:12]}"
        while True:
            try:
                self._client = await DpcoordClient.connect(
                    self.settings, client_id=client_id, timeout=2.0, tracer=self.tracer
                )
                break
            except (ClientError, TimeoutError, OSError, NatsError) as exc:
                log.info("gateway: NATS or the coordinator not reachable yet (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, CONNECT_RETRY_MAX_S)
        self.connected.set()
        log.info("gateway connected to coordinator %s as %s", self._client.coordinator_id, client_id)

    @property
    def client(self) -> DpcoordClient:
        if self._client is None:
            raise GatewayError(503, "the gateway is not connected to a coordinator yet")
        return self._client

    def _authorize(self, scope: Scope) -> None:
        authorization = header(scope, b"authorization")
        if self.api_keys.required and not self.api_keys.allows(
            authorization.decode("latin-1") if authorization is not None else None
        ):
            self._refusal_log.warning("refused %s %s: missing or wrong API key", scope["method"], scope["path"])
            raise GatewayError(401, "a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key")

    # ------------------------------------------------------------ probes

    async def healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = self._client
        if client is None or not client.nc.is_connected:
            await respond(send, 503, b"not ok: not connected to NATS\n", TEXT)
        else:
            await respond(send, 200, b"ok: connected to NATS\n", TEXT)

    async def readyz(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.draining:
            await respond(send, 503, b"not ok: draining\n", TEXT)
            return
        try:
            models = await self.client.list_models(timeout=2.0)
        except (GatewayError, ClientError, TimeoutError) as exc:
            await respond(send, 503, f"not ok: {exc}\n".encode(), TEXT)
            return
        if not models.models:
            await respond(send, 503, b"not ok: no engine serves a model\n", TEXT)
            return
        await respond(send, 200, f"ok: {', '.join(model.name for model in models.models)}\n".encode(), TEXT)

    async def prometheus(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST.encode())

    # ------------------------------------------------------------ OpenAI API

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._models(scope, send, self._cards)

    async def model(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/models/{id}``: one card, or 404 ``model_not_found`` (ids may hold slashes)."""
        name = scope["path"][len(MODELS_PREFIX) :]

        def card(listing: ModelList) -> ModelCard:
            for served in listing.models:
                if served.name == name:
                    return ModelCard(served.name, self.started)
            raise GatewayError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

        await self._models(scope, send, card)

    def _cards(self, listing: ModelList) -> ModelCards:
        return ModelCards([ModelCard(model.name, self.started) for model in listing.models])

    async def _models(self, scope: Scope, send: Send, answer: Callable[[ModelList], msgspec.Struct]) -> None:
        try:
            self._authorize(scope)
            listing = await self.client.list_models(timeout=5.0)
            body = json_encoder.encode(answer(listing))
        except GatewayError as err:
            await respond_error(send, err)
            return
        except ClientError as exc:
            await respond_error(send, from_wire(exc.code, exc.message))
            return
        except TimeoutError as exc:
            await respond_error(send, GatewayError(ErrorCode.TIMED_OUT, str(exc)))
            return
        await respond(send, 200, body)
