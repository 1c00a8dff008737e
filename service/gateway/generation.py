"""The generation routes, ``POST /v1/completions`` and ``POST /v1/chat/completions``, as plain
ASGI handlers: API key, then Content-Type, then the body (bounded in bytes and time), then one
submission per choice through the client library. An ``X-Session-ID`` header names the
conversation the request continues (its submissions carry it as ``session_id``), and the ``n``
choices of one prompt share a ``group_id``: with ``cache_aware`` routing both stay on one engine.

A streamed request waits for its first reply before answering, so an error before the first token
is a plain HTTP error; a choice that fails after that (any of several) ends the stream with an
error event and ``[DONE]``, never silently. The replies ready together go out as one write
(:class:`service.gateway.streaming.Replies`). A client that disconnects gets its submissions
aborted, which frees their engine slots and KV memory.

While the gateway drains (service/gateway/server.py), a new generation request is answered 503
``shutting_down``; those in progress at the drain's deadline are cut (:meth:`Requests.cut`): a
stream ends with an error event and ``[DONE]``, a request not answered yet (non-streamed, or a
stream waiting for its first reply) gets a 503 ``shutting_down`` error body, and the submissions
of both are aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.types import Receive, Scope, Send

from service.client import ClientError, DpcoordClient, FlowLimits
from service.gateway.asgi import check_json, header, read_body, respond, respond_error
from service.gateway.disconnects import DisconnectWatch, watch_disconnect
from service.gateway.errors import GatewayError, from_validation, from_wire
from service.gateway.metrics import GatewayMetrics
from service.gateway.responses import answered_usage, chat_response, completion_response, usage_of
from service.gateway.schemas import Usage, chat_decoder, completion_decoder, json_encoder
from service.gateway.streaming import ChunkWriter, Replies, send_stream, sse_events
from service.gateway.translate import Job, Plan, chat_plan, completion_plan
from service.ops.settings import Settings
from service.protocol.errors import ErrorCode
from service.protocol.messages import Final

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer

log = logging.getLogger(__name__)
Sent = TypeVar("Sent")
SESSION_HEADER = b"x-session-id"
MAX_SESSION_ID = 256  # characters, as the wire's session_id


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One generation route: how its body is read, planned and answered."""

    name: str
    decode: Callable[[bytes], Any]
    plan: Callable[[Any], Plan]
    respond: Callable[[Plan, list[Final], Usage], msgspec.Struct]
    chat: bool


COMPLETIONS = Endpoint("completions", completion_decoder.decode, completion_plan, completion_response, chat=False)
CHAT = Endpoint("chat.completions", chat_decoder.decode, chat_plan, chat_response, chat=True)


class Generation:
    """Serves one endpoint; ``client`` raises a 503 GatewayError while not connected and
    ``authorize`` a 401 for a missing or wrong key. With a ``tracer``, each request is a span
    continuing the HTTP client's ``traceparent``, the current span while it is served."""

    def __init__(
        self,
        endpoint: Endpoint,
        settings: Settings,
        metrics: GatewayMetrics,
        client: Callable[[], DpcoordClient],
        authorize: Callable[[Scope], None],
        requests: Requests,
        draining: Callable[[], bool],
        tracer: Tracer | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._tracer = tracer
        self.settings = settings
        self.metrics = metrics
        self._client = client
        self._authorize = authorize
        self._requests = requests
        self._draining = draining
        self._timeout = settings.request_timeout_s
        self._flow = FlowLimits(settings.gateway_stream_buffer_bytes, settings.gateway_stream_stall_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        requests = self._requests
        task = requests.enter()
        try:
            tracer = self._tracer
            if tracer is None:
                await self._serve(task, scope, receive, send)
                return
            traceparent = header(scope, b"traceparent")
            with tracer.http_request(
                "POST", scope["path"], traceparent.decode("latin-1") if traceparent else None
            ) as span:
                span.answered(await self._serve(task, scope, receive, send))
        finally:
            requests.leave(task)

    async def _serve(self, task: asyncio.Task[Any], scope: Scope, receive: Receive, send: Send) -> int:
        """Serve one request; its HTTP status."""
        started = time.perf_counter()
        metrics = self.metrics
        metrics.in_flight += 1
        status = 200
        try:
            if self._draining():
                raise shutting_down("it takes no new requests")
            stream = await self._answer(scope, receive, send)
        except GatewayError as err:
            stream, status = None, err.status
            await respond_error(send, err)
        except ClientError as exc:
            refusal = from_wire(exc.code, exc.message)
            stream, status = None, refusal.status
            await respond_error(send, refusal)
        except TimeoutError as exc:
            stream, status = None, ErrorCode.TIMED_OUT
            await respond_error(send, GatewayError(ErrorCode.TIMED_OUT, str(exc)))
        except asyncio.CancelledError:
            if not self._requests.cutting:
                raise
            task.uncancel()
            stream, status = None, 503
            await respond_error(send, shutting_down("the request was cut"))
        if stream is None:
            metrics.in_flight -= 1
            metrics.answered(self.endpoint.name, status, time.perf_counter() - started)
            return status
        try:
            await self._requests.write(task, stream, send)
        finally:
            metrics.disconnects += stream.watch.disconnected
            metrics.in_flight -= 1
            metrics.answered(self.endpoint.name, 200, time.perf_counter() - started)
            metrics.used(stream.usage())
        return 200

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> EventStream | None:
        """Answers a non-streamed request itself; returns a stream whose first reply arrived."""
        self._authorize(scope)
        check_json(scope)
        body = await read_body(scope, receive, self.settings.max_payload_bytes)
        endpoint = self.endpoint
        try:
            plan = endpoint.plan(endpoint.decode(body))
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
            raise from_validation(exc, body) from None
        session_id = session_of(scope)
        client = self._client()
        ids = [f"{plan.id}-{job.index}" for job in plan.jobs]
        if plan.stream:
            try:
                return await self._stream(
                    client, plan, ids, DisconnectWatch(receive, lambda: aborted(client, ids)), session_id
                )
            except asyncio.CancelledError:
                await self._abort_if_cut(client, ids)
                raise
        watch = watch_disconnect(scope, receive, lambda: aborted(client, ids))
        try:
            finals = await self._complete(client, plan, ids, session_id)
        except asyncio.CancelledError:
            await self._abort_if_cut(client, ids)
            raise
        finally:
            watch.stop()
            self.metrics.disconnects += watch.disconnected
        usage = answered_usage(plan, finals)
        self.metrics.used(usage)
        await respond(send, 200, json_encoder.encode(endpoint.respond(plan, finals, usage)))
        return None

    async def _abort_if_cut(self, client: DpcoordClient, ids: list[str]) -> None:
        """A drain cut this request before it was answered: abort its submissions."""
        if self._requests.cutting:
            await asyncio.shield(aborted(client, ids))

    def _send(
        self,
        call: Callable[..., Sent],
        plan: Plan,
        job: Job,
        client_request_id: str,
        session_id: str | None,
        **flow: Any,
    ) -> Sent:
        """``job`` through ``call``: the client's ``submit`` or ``stream_batches``, which take the
        same arguments (``stream_batches`` also the bounds of its ``flow``). The ``n`` samples of
        one prompt form a group."""
        return call(
            job.prompt,
            messages=job.messages,
            model=plan.model,
            client_request_id=client_request_id,
            timeout=self._timeout,
            session_id=session_id,
            group_id=f"{plan.id}-g{job.index // plan.n}" if plan.n > 1 else None,
            **flow,
            **plan.sampling,
        )

    async def _complete(self, client: DpcoordClient, plan: Plan, ids: list[str], session_id: str | None) -> list[Final]:
        if len(ids) == 1:
            return [await self._send(client.submit, plan, plan.jobs[0], ids[0], session_id)]
        outcomes = await asyncio.gather(
            *(self._send(client.submit, plan, job, rid, session_id) for job, rid in zip(plan.jobs, ids, strict=True)),
            return_exceptions=True,
        )
        finals = [outcome for outcome in outcomes if isinstance(outcome, Final)]
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return finals

    async def _stream(
        self, client: DpcoordClient, plan: Plan, ids: list[str], watch: DisconnectWatch, session_id: str | None
    ) -> EventStream:
        """Wait for the first reply, so an error before the first token is a plain HTTP error."""
        flow = self._flow
        replies = Replies(
            (job, self._send(client.stream_batches, plan, job, rid, session_id, flow=flow))
            for job, rid in zip(plan.jobs, ids, strict=True)
        )
        try:
            first = await replies.batch()
        except BaseException:
            watch.stop()
            await replies.aclose()
            raise
        writer = ChunkWriter(plan, self.endpoint.chat)
        return EventStream(writer, sse_events(writer, first, replies), replies, watch, lambda: aborted(client, ids))


class EventStream:
    """A stream whose first reply arrived: its events, written by :meth:`Requests.write`."""

    def __init__(
        self,
        writer: ChunkWriter,
        events: AsyncGenerator[bytes, None],
        replies: Replies,
        watch: DisconnectWatch,
        abort: Callable[[], Awaitable[bool]],
    ) -> None:
        self.writer = writer
        self.events = events
        self.replies = replies
        self.watch = watch
        self.abort = abort

    def usage(self) -> Usage:
        writer = self.writer
        finals = [(index, choice.final) for index, choice in writer.choices.items() if choice.final is not None]
        return usage_of(writer.plan, finals)


def shutting_down(why: str) -> GatewayError:
    return GatewayError(503, f"the gateway is shutting down; {why}", code="shutting_down")


class Requests:
    """The generation requests in progress, streamed or not, so that a drain waits for them and
    cuts those still running at its deadline (the module docstring says how each ends)."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.cutting = False  # cut() was called: a cancelled request was cut, not abandoned
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._running)

    def enter(self) -> asyncio.Task[Any]:
        """Count the current task's request as in progress until :meth:`leave` (a try/finally at
        the caller: a context manager's generator would cost more than the rest of this)."""
        loop = self._loop
        if loop is None:  # kept from the first request: on Python 3.11 each lookup costs a getpid()
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a request is served from a task")
        self._running.add(task)
        self._idle.clear()
        return task

    def leave(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if not self._running:
            self._idle.set()

    async def idle(self) -> None:
        """Returns once no request is in progress."""
        await self._idle.wait()

    async def write(self, task: asyncio.Task[Any], stream: EventStream, send: Send) -> None:
        """Write ``stream``, ending it with an error event and ``[DONE]`` if it is cut."""
        try:
            async with aclosing(stream.replies), aclosing(stream.events):
                await send_stream(send, stream.events, stream.watch)
        except asyncio.CancelledError:
            if not self.cutting:
                raise
            task.uncancel()
            cut = shutting_down("the stream was cut")
            await send({"type": "http.response.body", "body": b"data: " + cut.body() + b"\n\ndata: [DONE]\n\n"})
            await asyncio.shield(stream.abort())

    def cut(self) -> int:
        """End every request in progress now; returns how many."""
        self.cutting = True
        for task in self._running:
            task.cancel()
        return len(self._running)


def session_of(scope: Scope) -> str | None:
    """The request's ``X-Session-ID`` (None without one); 400 when it is empty, too long or not UTF-8."""
    raw = header(scope, SESSION_HEADER)
    if raw is None:
        return None
    try:
        session_id = raw.decode()
    except UnicodeDecodeError:
        session_id = ""
    if not 0 < len(session_id) <= MAX_SESSION_ID:
        raise GatewayError(400, f"X-Session-ID must be 1 to {MAX_SESSION_ID} characters of UTF-8", "X-Session-ID")
    return session_id


async def aborted(client: DpcoordClient, ids: list[str]) -> bool:
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
