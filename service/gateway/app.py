"""The gateway's ASGI application: OpenAI's HTTP API in front of the fleet.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, and
``/healthz`` (connected to NATS), ``/readyz`` (the coordinator answers and some engine serves a
model) and ``/metrics`` (Prometheus), which need no API key.

Each HTTP request becomes one submission per choice through the client library
(:mod:`service.client`), so deadlines, idempotent resubmission and refused publishes work as for
any client. A body over ``max_payload_bytes`` is refused with 413 before anything is read past
the limit or sent on NATS. A client that disconnects gets its submissions aborted, which frees
their engine slots and KV memory. Errors are OpenAI error bodies (service/gateway/errors.py).

The gateway imports the client library and layers 1-3 only: never the coordinator, the handlers
or the engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.errors import Error as NatsError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from service.client import ClientError, DpcoordClient
from service.gateway.auth import ApiKeys
from service.gateway.errors import GatewayError, from_validation, from_wire
from service.gateway.metrics import GatewayMetrics
from service.gateway.schemas import ModelCard, ModelCards, chat_decoder, completion_decoder, json_encoder
from service.gateway.streaming import ChunkWriter, DisconnectWatch, Reply, send_stream, sse_events
from service.gateway.translate import (
    Job,
    Plan,
    chat_plan,
    chat_response,
    completion_plan,
    completion_response,
    usage_of,
)
from service.ops.log_limit import RateLimitedLog
from service.ops.settings import Settings
from service.protocol.errors import ErrorCode
from service.protocol.messages import Final

log = logging.getLogger(__name__)

JSON = "application/json"
CONNECT_RETRY_MAX_S = 2.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One generation route: how its body is read, planned and answered."""

    name: str
    decode: Callable[[bytes], Any]
    plan: Callable[[Any], Plan]
    respond: Callable[[Plan, list[Final]], msgspec.Struct]
    chat: bool


COMPLETIONS = Endpoint("completions", completion_decoder.decode, completion_plan, completion_response, chat=False)
CHAT = Endpoint("chat.completions", chat_decoder.decode, chat_plan, chat_response, chat=True)


class Gateway:
    """Owns the client library connection; ``app`` is the ASGI application that uses it."""

    def __init__(self, settings: Settings, api_keys: ApiKeys) -> None:
        self.settings = settings
        self.api_keys = api_keys
        self.started = int(time.time())
        self.metrics = GatewayMetrics(lambda: self._client.nc if self._client is not None else None)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.metrics)
        self.connected = asyncio.Event()
        self._client: DpcoordClient | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._refusal_log = RateLimitedLog(log)
        self.app = Router(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET", "HEAD"]),
                Route("/readyz", self.readyz, methods=["GET", "HEAD"]),
                Route("/metrics", self.prometheus, methods=["GET", "HEAD"]),
            ],
            lifespan=self._lifespan,
        )

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

    @asynccontextmanager
    async def _lifespan(self, app: object) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def _connect(self) -> None:
        delay = 0.1
        client_id = f"gateway-{uuid.uuid4().hex[:12]}"
        while True:
            try:
                self._client = await DpcoordClient.connect(self.settings, client_id=client_id, timeout=2.0)
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

    # ------------------------------------------------------------ probes

    async def healthz(self, request: Request) -> Response:
        client = self._client
        if client is None or not client.nc.is_connected:
            return Response("not ok: not connected to NATS\n", 503)
        return Response("ok: connected to NATS\n")

    async def readyz(self, request: Request) -> Response:
        try:
            models = await self.client.list_models(timeout=2.0)
        except (GatewayError, ClientError, TimeoutError) as exc:
            return Response(f"not ok: {exc}\n", 503)
        if not models.models:
            return Response("not ok: no engine serves a model\n", 503)
        return Response(f"ok: {', '.join(model.name for model in models.models)}\n")

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------ OpenAI API

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            listing = await self.client.list_models(timeout=5.0)
        except GatewayError as err:
            return _error(err)
        except ClientError as exc:
            return _error(from_wire(exc.code, exc.message))
        except TimeoutError as exc:
            return _error(GatewayError(ErrorCode.TIMED_OUT, str(exc)))
        cards = ModelCards([ModelCard(model.name, self.started) for model in listing.models])
        return Response(json_encoder.encode(cards), media_type=JSON)

    async def completions(self, request: Request) -> Response | EventStream:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response | EventStream:
        return await self._generate(request, CHAT)

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response | EventStream:
        started = time.perf_counter()
        self.metrics.in_flight += 1
        try:
            answer = await self._answer(request, endpoint, started)
            status = 200
        except GatewayError as err:
            answer, status = _error(err), err.status
        except ClientError as exc:
            refusal = from_wire(exc.code, exc.message)
            answer, status = _error(refusal), refusal.status
        except TimeoutError as exc:
            answer, status = _error(GatewayError(ErrorCode.TIMED_OUT, str(exc))), ErrorCode.TIMED_OUT
        if not isinstance(answer, EventStream):  # a stream counts once it ends
            self.metrics.in_flight -= 1
            self.metrics.answered(endpoint.name, status, time.perf_counter() - started)
        return answer

    async def _answer(self, request: Request, endpoint: Endpoint, started: float) -> Response | EventStream:
        self._authorize(request)
        try:
            plan = endpoint.plan(endpoint.decode(await self._body(request)))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise from_validation(exc) from None
        client = self.client
        ids = [f"{plan.id}-{job.index}" for job in plan.jobs]
        watch = DisconnectWatch(request.receive, lambda: self._aborted(client, ids))
        if plan.stream:
            return await self._stream(endpoint, client, plan, ids, watch, started)
        try:
            finals = await self._complete(client, plan, ids)
        finally:
            watch.stop()
            self.metrics.disconnects += watch.disconnected
        self.metrics.used(usage_of(finals))
        return Response(json_encoder.encode(endpoint.respond(plan, finals)), media_type=JSON)

    def _authorize(self, request: Request) -> None:
        if self.api_keys.required and not self.api_keys.allows(_header(request, b"authorization")):
            self._refusal_log.warning("refused %s %s: missing or wrong API key", request.method, request.url.path)
            raise GatewayError(401, "a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        """The body, refused with 413 past ``max_payload_bytes`` before anything reaches NATS."""
        limit = self.settings.max_payload_bytes
        declared = _header(request, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        body = b""
        while True:
            message = await request.receive()
            if message["type"] != "http.request":
                raise GatewayError(400, "the client left before sending the whole body")
            body += message.get("body", b"")
            if len(body) > limit:
                raise _too_large(len(body), limit)
            if not message.get("more_body", False):
                return body

    def _submission(self, plan: Plan, job: Job, client_request_id: str) -> dict[str, Any]:
        return dict(
            prompt=job.prompt,
            messages=job.messages,
            model=plan.model,
            client_request_id=client_request_id,
            timeout=self.settings.request_timeout_s,
            **plan.sampling,
        )

    async def _complete(self, client: DpcoordClient, plan: Plan, ids: list[str]) -> list[Final]:
        if len(plan.jobs) == 1:
            return [await client.submit(**self._submission(plan, plan.jobs[0], ids[0]))]
        outcomes = await asyncio.gather(
            *(client.submit(**self._submission(plan, job, rid)) for job, rid in zip(plan.jobs, ids, strict=True)),
            return_exceptions=True,
        )
        finals = [outcome for outcome in outcomes if isinstance(outcome, Final)]
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return finals

    async def _stream(
        self,
        endpoint: Endpoint,
        client: DpcoordClient,
        plan: Plan,
        ids: list[str],
        watch: DisconnectWatch,
        started: float,
    ) -> EventStream:
        """Wait for the first reply, so an error before the first token is a plain HTTP error."""
        replies = self._replies(client, plan, ids)
        try:
            first = await anext(replies)
        except BaseException:
            watch.stop()
            await replies.aclose()
            raise
        writer = ChunkWriter(plan, endpoint.chat)

        def done() -> None:
            self.metrics.disconnects += watch.disconnected
            self.metrics.in_flight -= 1
            self.metrics.answered(endpoint.name, 200, time.perf_counter() - started)
            self.metrics.used(usage_of(choice.final for choice in writer.choices.values() if choice.final is not None))

        return EventStream(sse_events(writer, first, replies), replies, watch, done)

    async def _replies(self, client: DpcoordClient, plan: Plan, ids: list[str]) -> AsyncGenerator[Reply, None]:
        """Every reply of the plan's submissions, interleaved as they arrive."""
        if len(plan.jobs) == 1:
            job = plan.jobs[0]
            async with aclosing(client.stream(**self._submission(plan, job, ids[0]))) as replies:
                async for reply in replies:
                    yield job, reply
            return
        queue: asyncio.Queue[Reply | BaseException | None] = asyncio.Queue()

        async def pump(job: Job, client_request_id: str) -> None:
            try:
                async with aclosing(client.stream(**self._submission(plan, job, client_request_id))) as replies:
                    async for reply in replies:
                        queue.put_nowait((job, reply))
            except (ClientError, TimeoutError) as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        pumps = [asyncio.ensure_future(pump(job, rid)) for job, rid in zip(plan.jobs, ids, strict=True)]
        try:
            running = len(pumps)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in pumps:
                task.cancel()

    async def _aborted(self, client: DpcoordClient, ids: list[str]) -> bool:
        """The HTTP client left: abort its submissions, so engines free their slots and KV memory.
        False when some submission was not found (not arrived yet, or already ended)."""
        found = await asyncio.gather(*(_abort(client, client_request_id) for client_request_id in ids))
        return all(found)


async def _abort(client: DpcoordClient, client_request_id: str) -> bool:
    """True when the coordinator held the request (and so aborts it)."""
    try:
        await client.abort(client_request_id, timeout=5.0)
        return True
    except ClientError as exc:
        if exc.code != ErrorCode.NOT_FOUND:
            log.warning("abort of client_request_id=%s failed: %s", client_request_id, exc)
    except TimeoutError as exc:
        log.warning("abort of client_request_id=%s not answered: %s", client_request_id, exc)
    return False


def _header(request: Request, name: bytes) -> str | None:
    """One request header, read from the ASGI scope (cheaper than Starlette's ``Headers``)."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _too_large(size: int, limit: int) -> GatewayError:
    return GatewayError(413, f"request body of {size} bytes exceeds the {limit}-byte limit", code="payload_too_large")


def _error(err: GatewayError) -> Response:
    return Response(err.body(), err.status, headers=err.headers(), media_type=JSON)


class EventStream:
    """The ASGI response of a stream whose first reply arrived: its events, then ``on_done``."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        replies: AsyncGenerator[Reply, None],
        watch: DisconnectWatch,
        on_done: Callable[[], None],
    ) -> None:
        self._events = events
        self._replies = replies
        self._watch = watch
        self._on_done = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with aclosing(self._replies), aclosing(self._events):
                await send_stream(send, self._events, self._watch)
        finally:
            self._on_done()
