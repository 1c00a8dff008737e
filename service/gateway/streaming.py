"""Streamed responses as Server-Sent Events, and aborting when the HTTP client goes away.

A stream is ``data: {chunk}`` events, then ``data: [DONE]``: for a chat, a first chunk per
choice with ``role: assistant``, content deltas as partials arrive, a last chunk with the
``finish_reason``; for a completion, text chunks and a last one with the ``finish_reason``. With
``stream_options.include_usage`` a chunk with empty ``choices`` and the ``usage`` comes before
``[DONE]``. An error after the stream began is a ``data: {"error": ...}`` event, then ``[DONE]``:
exactly one ``[DONE]`` ends every stream.

:class:`DisconnectWatch` listens for ``http.disconnect`` while a request is served and calls its
``on_disconnect`` (the gateway aborts the request's submissions, so the engine frees them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.types import Receive, Send

from service.client import ClientError
from service.gateway.errors import GatewayError, from_wire
from service.gateway.schemas import (
    ChatCompletionChunk,
    ChatDeltaChoice,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    json_encoder,
)
from service.gateway.translate import Job, Plan, usage_of
from service.protocol.messages import Final, Partial

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

Reply = tuple[Job, Partial | Final]


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class DisconnectWatch:
    """Waits for the HTTP client to leave, until ``stop()``; then calls ``on_disconnect``, which
    answers whether it found every submission to abort.

    A client that leaves within moments of its request can beat its submission to the
    coordinator, which then knows no such request; a stream then calls ``on_disconnect`` once
    more at the next reply (:meth:`replied`), when the submission has surely arrived."""

    def __init__(self, receive: Receive, on_disconnect: Callable[[], Awaitable[bool]]) -> None:
        self.disconnected = False
        self._receive = receive
        self._on_disconnect = on_disconnect
        self._stopped = False
        self._missed = False
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._stopped:
            self.disconnected = True
            self._missed = not await self._on_disconnect()

    async def replied(self) -> None:
        if self._missed:
            self._missed = False
            await self._on_disconnect()

    def stop(self) -> None:
        """The response is complete: a disconnect from now on is the connection closing normally."""
        self._stopped = True
        self._task.cancel()


@dataclass(slots=True)
class _Choice:
    streamed: str = ""  # text sent so far
    started: bool = False  # a chat choice's role chunk is out
    final: Final | None = None


@dataclass(slots=True)
class ChunkWriter:
    """Turns replies into the chunks of one plan's stream."""

    plan: Plan
    chat: bool
    choices: dict[int, _Choice] = field(default_factory=dict)

    def chunks(self, job: Job, reply: Partial | Final) -> list[bytes]:
        choice = self.choices.setdefault(job.index, _Choice())
        out: list[bytes] = []
        if self.chat and not choice.started:
            choice.started = True
            out.append(self._chat(job.index, ChatMessageOut("assistant", ""), None))
        if isinstance(reply, Partial):
            choice.streamed += reply.text
            if reply.text:
                out.append(self._piece(job.index, reply.text, None))
            return out
        choice.final = reply
        text = reply.generated_text
        rest = text[len(choice.streamed) :] if text.startswith(choice.streamed) else ""
        out.append(self._piece(job.index, rest, reply.finish_reason))
        return out

    def usage(self) -> bytes:
        finals = [choice.final for choice in self.choices.values() if choice.final is not None]
        usage = usage_of(finals)
        if self.chat:
            return event(
                json_encoder.encode(ChatCompletionChunk(self.plan.id, self.plan.created, self.plan.model, [], usage))
            )
        return event(json_encoder.encode(Completion(self.plan.id, self.plan.created, self.plan.model, [], usage)))

    def _piece(self, index: int, text: str, finish_reason: str | None) -> bytes:
        if self.chat:
            delta = ChatMessageOut(content=text) if text or finish_reason is None else ChatMessageOut()
            return self._chat(index, delta, finish_reason)
        plan = self.plan
        return event(
            json_encoder.encode(
                Completion(plan.id, plan.created, plan.model, [CompletionChoice(index, text, finish_reason)])
            )
        )

    def _chat(self, index: int, delta: ChatMessageOut, finish_reason: str | None) -> bytes:
        plan = self.plan
        chunk = ChatCompletionChunk(plan.id, plan.created, plan.model, [ChatDeltaChoice(index, delta, finish_reason)])
        return event(json_encoder.encode(chunk))


async def sse_events(writer: ChunkWriter, first: Reply, rest: AsyncIterator[Reply]) -> AsyncGenerator[bytes, None]:
    """Every event of a stream whose first reply already arrived, ending with one ``[DONE]``."""
    try:
        for chunk in writer.chunks(*first):
            yield chunk
        async for job, reply in rest:
            for chunk in writer.chunks(job, reply):
                yield chunk
    except ClientError as exc:
        yield event(from_wire(exc.code, exc.message).body())
    except TimeoutError as exc:
        yield event(GatewayError(504, str(exc)).body())
    else:
        if writer.plan.include_usage:
            yield writer.usage()
    yield DONE


async def send_stream(send: Send, events: AsyncIterator[bytes], watch: DisconnectWatch) -> None:
    """Write a stream as the ASGI response; events keep being read after a disconnect, so the
    submission ends (the abort's final) instead of being left to run."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    try:
        async for chunk in events:
            if watch.disconnected:
                await watch.replied()
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        watch.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watch.stop()
