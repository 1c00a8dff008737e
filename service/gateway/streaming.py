"""Streamed responses as Server-Sent Events, and aborting when the HTTP client goes away.

A stream is ``data: {chunk}`` events, then ``data: [DONE]``: for a chat, a first chunk per
choice with ``role: assistant``, content deltas as partials arrive, a last chunk with the
``finish_reason``; for a completion, text chunks and a last one with the ``finish_reason``. With
``stream_options.include_usage`` a chunk with empty ``choices`` and the ``usage`` comes before
``[DONE]``; with ``stream_options.continuous_usage_stats`` every chunk carries the usage so far
too (its ``prompt_tokens`` counts the prompts whose length is known yet: token-id prompts from
the start, text prompts once their final arrived). An error after the stream began is a
``data: {"error": ...}`` event, then ``[DONE]``: exactly one ``[DONE]`` ends every stream.

Stop strings are left out of the text as OpenAI does: with stop strings, the last characters
that could begin one are held back until the next partial or the final tells (at most the
longest stop string less one character). The events one reply produces go out as one write.

With log-probabilities asked, each text chunk carries those of its own tokens
(service/gateway/logprobs.py): without stop strings a partial's tokens go with its chunk; with
them a token goes once its whole text was sent, so the tokens of a stop string cut from the text
never go. An echoed completion choice is held whole until its final, which alone carries the
prompt's logprobs. Disconnects are watched in service/gateway/disconnects.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field

from starlette.types import Send

from service.client import ClientError
from service.gateway.disconnects import DisconnectWatch
from service.gateway.errors import GatewayError, from_wire
from service.gateway.logprobs import ChoiceScores, Scores, TokenNames, chat_logprobs, completion_logprobs
from service.gateway.responses import rest_of, usage_of
from service.gateway.schemas import (
    ChatCompletionChunk,
    ChatDeltaChoice,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
    json_encoder,
)
from service.gateway.translate import Job, Plan
from service.protocol.messages import Final, Partial

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

Reply = tuple[Job, Partial | Final]


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


@dataclass(slots=True)
class _Choice:
    """One choice's text so far: what was sent, in pieces, and what is held back (so that
    neither is copied whole per event: a long stream costs time linear in its length)."""

    held: str = ""  # text of the partials not sent yet
    sent: list[str] = field(default_factory=list)  # the pieces sent so far
    stopped: bool = False  # a stop string was seen: nothing more is sent before the final
    tokens: int = 0  # tokens of the partials so far
    started: bool = False  # a chat choice's role chunk is out
    final: Final | None = None
    scores: ChoiceScores | None = None  # with logprobs asked: its tokens' (none for an echo: all wait for the final)


@dataclass(slots=True)
class ChunkWriter:
    """Turns replies into the chunks of one plan's stream."""

    plan: Plan
    chat: bool
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt group -> its length, once known
    templates: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # choice -> _template

    def events(self, batch: list[Reply]) -> bytes:
        """The events of the replies ready together, as one piece (empty when there are none)."""
        if len(batch) == 1:
            return b"".join(self.chunks(*batch[0]))  # joins one chunk without copying it
        return b"".join([chunk for job, reply in batch for chunk in self.chunks(job, reply)])

    def chunks(self, job: Job, reply: Partial | Final) -> list[bytes]:
        plan = self.plan
        choice = self.choices.get(job.index)
        if choice is None:
            choice = self.choices[job.index] = _Choice()
            if plan.logprobs is not None and not plan.echo:
                choice.scores = ChoiceScores()
            if isinstance(job.prompt, list):
                self.prompt_tokens[job.index // plan.n] = len(job.prompt)
        out: list[bytes] = []
        if self.chat and not choice.started:
            choice.started = True
            out.append(self._chat(job.index, ChatMessageOut("assistant", ""), None))
        if isinstance(reply, Partial):
            if choice.scores is not None or plan.echo:
                self._scored(job, choice, reply, out)
                return out
            choice.held += reply.text
            choice.tokens += len(reply.new_tokens)
            text = self._releasable(choice)
            if text:
                choice.sent.append(text)
                out.append(self._piece(job.index, text, None))
            return out
        choice.final = reply
        choice.tokens = 0 if plan.echo_only else len(reply.generated_tokens)
        if reply.prompt_tokens is not None:
            self.prompt_tokens[job.index // plan.n] = reply.prompt_tokens
        rest = rest_of(plan, job, reply, "".join(choice.sent), choice.scores)
        if rest.tokens is None:
            out.append(self._piece(job.index, rest.text, rest.finish_reason))
        else:
            logprobs = rest.chat_logprobs(plan) if self.chat else rest.completion_logprobs(plan)
            out.append(self._piece(job.index, rest.text, rest.finish_reason, logprobs))
        return out

    def _scored(self, job: Job, choice: _Choice, reply: Partial, out: list[bytes]) -> None:
        """A partial of a choice with logprobs asked: its text and the tokens that go with it;
        an echoed choice's only counts its tokens (it waits for its final)."""
        plan = self.plan
        if not plan.echo_only:
            choice.tokens += len(reply.new_tokens)
        scores = choice.scores
        if scores is None:  # echo
            return
        choice.held += reply.text
        text = self._releasable(choice)
        scores.partial(reply.new_tokens, reply.token_logprobs, reply.top_logprobs, reply.token_bytes)
        tokens = scores.release(len(text) if plan.stops else None)
        if text or tokens:
            choice.sent.append(text)
            out.append(self._encoded(job.index, text, None, self._logprobs(tokens, scores.names)))

    def _logprobs(self, tokens: Scores, names: TokenNames) -> ChatLogprobs | CompletionLogprobs:
        top = self.plan.logprobs or 0
        return chat_logprobs(tokens, names, top) if self.chat else completion_logprobs(tokens, names, top)

    def _releasable(self, choice: _Choice) -> str:
        """The held text that can be sent now (it leaves ``held``): all of it without stop
        strings; else what cannot be the start of a stop string, and nothing from a stop string
        on. Only held text can hold a stop string's start: sent text was checked when it arrived
        and, whole stop strings included, when what followed it did."""
        held, stops = choice.held, self.plan.stops
        if not stops:
            choice.held = ""
            return held
        if choice.stopped:
            return ""
        end = len(held) - max(len(stop) for stop in stops) + 1
        if not self.plan.min_tokens:  # the first stop string to occur is the one that ends the choice
            for stop in stops:
                at = held.find(stop)
                if at >= 0:
                    choice.stopped = True
                    end = min(end, at)
        if end <= 0:
            return ""
        choice.held = held[end:]
        return held[:end]

    def _usage_so_far(self) -> Usage | None:
        if not self.plan.continuous_usage:
            return None
        prompt = sum(self.prompt_tokens.values())
        completion = sum(choice.tokens for choice in self.choices.values())
        return Usage(prompt, completion, prompt + completion)

    def usage(self) -> bytes:
        finals = [(index, choice.final) for index, choice in self.choices.items() if choice.final is not None]
        usage = usage_of(self.plan, finals)
        if self.chat:
            return event(
                json_encoder.encode(ChatCompletionChunk(self.plan.id, self.plan.created, self.plan.model, [], usage))
            )
        return event(json_encoder.encode(Completion(self.plan.id, self.plan.created, self.plan.model, [], usage)))

    def _piece(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: ChatLogprobs | CompletionLogprobs | None = None,
    ) -> bytes:
        if (
            finish_reason is None and logprobs is None and not self.plan.continuous_usage
        ):  # a partial's text: the hot case
            template = self.templates.get(index)
            if template is None:
                template = self.templates[index] = self._template(index)
            return template[0] + json_encoder.encode(text) + template[1]
        return self._encoded(index, text, finish_reason, logprobs)

    def _template(self, index: int) -> tuple[bytes, bytes]:
        """Choice ``index``'s text event split around its text, so that ``head + JSON string +
        tail`` is exactly what :meth:`_encoded` gives, without building and encoding the chunk's
        structs per event. The split is at the key ``"text":`` (``"content":`` in a chat), which
        only the structure can hold: a quote inside a JSON string is escaped."""
        key = b'"content":' if self.chat else b'"text":'
        head, found, tail = self._encoded(index, "", None).partition(key + b'""')
        if not found:
            raise AssertionError(f"no {key!r} in a text chunk")
        return head + key, tail

    def _encoded(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: ChatLogprobs | CompletionLogprobs | None = None,
    ) -> bytes:
        if self.chat:
            delta = ChatMessageOut(content=text) if text or finish_reason is None else ChatMessageOut()
            return self._chat(index, delta, finish_reason, logprobs if isinstance(logprobs, ChatLogprobs) else None)
        plan = self.plan
        scored = logprobs if isinstance(logprobs, CompletionLogprobs) else None
        choices = [CompletionChoice(index, text, finish_reason, scored)]
        return event(json_encoder.encode(Completion(plan.id, plan.created, plan.model, choices, self._usage_so_far())))

    def _chat(
        self, index: int, delta: ChatMessageOut, finish_reason: str | None, logprobs: ChatLogprobs | None = None
    ) -> bytes:
        plan = self.plan
        choices = [ChatDeltaChoice(index, delta, finish_reason, logprobs)]
        chunk = ChatCompletionChunk(plan.id, plan.created, plan.model, choices, self._usage_so_far())
        return event(json_encoder.encode(chunk))


class Replies:
    """Every reply of a plan's submissions, interleaved as they arrive, through one queue, so that
    a stream takes all the replies ready at once and writes their events together. A submission's
    failure is raised after the replies that came before it. Each submission is read as the client
    library's ``stream_batches``: the replies that arrived together.

    The queue is bounded: each submission's pump has about one list of replies in it at a time,
    so a stream whose HTTP client stops reading stops taking its submissions' replies, which
    then wait in the client library's mailboxes, bounded there (service/client/flow.py).

    A plan of one submission (the common case) reads its batches directly: no pump task and no
    second queue, so the replies ready together wake one task once."""

    def __init__(self, streams: Iterable[tuple[Job, AsyncGenerator[list[Partial | Final], None]]]) -> None:
        pairs = list(streams)
        self._queue: asyncio.Queue[tuple[Job, list[Partial | Final]] | BaseException | None] = asyncio.Queue(
            max(1, len(pairs))
        )
        self._failure: BaseException | None = None
        self._only = pairs[0] if len(pairs) == 1 else None
        self._pumps = [] if self._only is not None else [asyncio.ensure_future(self._pump(*pair)) for pair in pairs]
        self._running = len(pairs)

    async def _pump(self, job: Job, stream: AsyncGenerator[list[Partial | Final], None]) -> None:
        queue = self._queue
        try:
            async with aclosing(stream):
                async for replies in stream:
                    await queue.put((job, replies))
        except Exception as exc:  # any failure of a choice reaches the stream, never silence
            await queue.put(exc)
        await queue.put(None)  # not when cancelled: then nothing reads the queue any more

    async def batch(self) -> list[Reply]:
        """The replies ready now (waiting for one if none is); empty once every stream ended."""
        if self._failure is not None:
            raise self._failure
        only = self._only
        if only is None:
            return await self._batch_of_many()
        if not self._running:  # one stream, read here: a coroutine less per reply
            return []
        job = only[0]
        try:
            return [(job, reply) for reply in await anext(only[1])]
        except StopAsyncIteration:
            self._running = 0
            return []
        except Exception as exc:
            self._failure = exc
            raise

    async def _batch_of_many(self) -> list[Reply]:
        queue = self._queue
        ready: list[Reply] = []
        while self._running and not ready:
            item = await queue.get()
            while True:
                if item is None:
                    self._running -= 1
                elif isinstance(item, BaseException):
                    self._failure = item
                    if not ready:
                        raise item
                    return ready
                else:
                    job, replies = item
                    ready.extend((job, reply) for reply in replies)
                if queue.empty():
                    break
                item = queue.get_nowait()
        return ready

    async def aclose(self) -> None:
        if self._only is not None:
            await self._only[1].aclose()
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


async def sse_events(writer: ChunkWriter, first: list[Reply], rest: Replies) -> AsyncGenerator[bytes, None]:
    """Every event of a stream whose first replies already arrived, ending with one ``[DONE]``;
    the events of the replies ready together are one piece."""
    try:
        batch = first
        while batch:
            piece = writer.events(batch)
            if piece:
                yield piece
            batch = await rest.batch()
    except ClientError as exc:
        yield event(from_wire(exc.code, exc.message).body())
    except GatewayError as exc:  # a reply the gateway cannot translate (an engine's bug)
        log.warning("stream %s failed: %s", writer.plan.id, exc.message)
        yield event(exc.body())
    except TimeoutError as exc:
        yield event(GatewayError(504, str(exc)).body())
    except Exception as exc:  # a bug or an unforeseen failure still ends the stream in words
        log.exception("stream %s failed", writer.plan.id)
        yield event(GatewayError(500, f"internal error: {type(exc).__name__}: {exc}").body())
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
