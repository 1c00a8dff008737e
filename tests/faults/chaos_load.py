"""Streamed chat completions through the official ``openai`` SDK, 200 at a time, each stream's
text compared exactly with the echo engine's, and a fault injected mid-load.

Each stream is counted once:

- ``exact``: it ended with ``finish_reason`` ``length`` and its text is the echo engine's;
- ``corrupt``: it ended normally (a ``finish_reason``) but its text or finish reason differs;
- ``hung``: no chunk for :data:`HUNG_AFTER_S` (before the response or between two chunks); the
  stream is then closed, so the suite's time stays bounded;
- ``error``: a clear error: an HTTP error status, or an error event in the stream;
- ``broken``: the connection failed, or the stream ended with neither a finish reason nor an
  error event (silently truncated).

The SDK runs with its default retries (2, on a 5xx or connection error before the response
starts), as applications run it: a retried request that then streams exactly counts as exact.

Every :data:`LOGPROBS_EVERY`-th stream asks for log-probabilities instead (``logprobs`` 2) and
runs through the client library, on NATS beside the gateway, through the same faults: it is
exact only when its text is, its final carries every token's logprob and alternatives equal to
the expected ones (the echo engine's function, or a torch reference run's within
:attr:`Logprobs.tolerance`), and its partials' logprobs add up to the start of the final's
(within the same tolerance).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

from engines.chat_template import plain_prompt
from engines.echo import echo_logprob, echo_top_logprobs
from service.client import ClientError, DpcoordClient
from service.protocol.messages import ChatMessage, Final, TopLogprob
from tests.faults.chaos import MODEL, ChaosStack, expected_text

IN_FLIGHT = 200
# Stream lengths: 160 to 400 tokens, 0.8 to 2 s at 5 ms a token.
MIN_TOKENS = 160
TOKEN_SPREAD = 241
# Well below the suite's per-test timeout, well above a recovery that works (heartbeat 1.5 s).
HUNG_AFTER_S = 10.0
OUTCOMES = ("exact", "corrupt", "hung", "error", "broken")
Fault = Callable[[], Awaitable[None]]
LOGPROBS_EVERY = 5  # every fifth stream asks for log-probabilities (through the client library)
LOGPROBS_K = 2


@dataclass(frozen=True)
class Logprobs:
    """The log-probabilities a stream's final must carry: each token's, and its alternatives
    (their ids exactly, their values within ``tolerance``; None: only each first one's id, the
    token itself, is compared: a greedy torch run)."""

    token_logprobs: Sequence[float]
    top_logprobs: Sequence[Sequence[TopLogprob]] | None
    tolerance: float = 0.0

    def matches(self, final: Final) -> bool:
        got, tops = final.token_logprobs, final.top_logprobs
        if got is None or tops is None or len(got) != len(self.token_logprobs) or len(tops) != len(got):
            return False
        if any(abs(a - b) > self.tolerance for a, b in zip(got, self.token_logprobs, strict=True)):
            return False
        if self.top_logprobs is None:
            return all(top[0][0] == token for top, token in zip(tops, final.generated_tokens, strict=True))
        return all(
            [token for token, _ in top] == [token for token, _ in want]
            and all(abs(a - b) <= self.tolerance for (_, a), (_, b) in zip(top, want, strict=True))
            for top, want in zip(tops, self.top_logprobs, strict=True)
        )


@dataclass(frozen=True)
class StreamCase:
    """One stream of a load: what is asked, and the text it must give (and, asking for
    log-probabilities, the ones it must give)."""

    content: str
    max_tokens: int
    expected: str
    extra_body: Mapping[str, object] | None = None
    model: str = MODEL
    logprobs: Logprobs | None = None


def echo_case(scenario: str, index: int) -> StreamCase:
    """The echo engines' load: a distinct prompt and length per stream, its text computed (and
    every :data:`LOGPROBS_EVERY`-th one's log-probabilities: engines/echo.py's function)."""
    content = f"{scenario} stream {index:05d}"
    max_tokens = MIN_TOKENS + index % TOKEN_SPREAD
    expected = expected_text(content, max_tokens)
    if index % LOGPROBS_EVERY:
        return StreamCase(content, max_tokens, expected)
    start = len(plain_prompt([ChatMessage("user", content)]).encode())
    positions = range(start, start + max_tokens)
    tokens = expected.encode()
    logprobs = Logprobs(
        [echo_logprob(token, p) for token, p in zip(tokens, positions, strict=True)],
        [echo_top_logprobs(token, p, LOGPROBS_K) for token, p in zip(tokens, positions, strict=True)],
    )
    return StreamCase(content, max_tokens, expected, logprobs=logprobs)


STREAMING_AT_FAULT = 20  # streams whose text has begun to reach the SDK when the first fault strikes
STREAMING_WAIT_S = 30.0
MAX_ERROR_SHARE = 0.01  # clear errors a scenario may give, as a share of its streams


@dataclass
class Tally:
    """One scenario's counts and how long it took."""

    scenario: str
    streams: int
    counts: Counter[str] = field(default_factory=Counter)
    logprobs_exact: int = 0  # exact streams that asked for log-probabilities (they are checked too)
    logprobs_resumed: int = 0  # of them, streams a later run answered (a retry or a migration: attempt > 0)
    max_gap_s: float = 0.0
    streaming: int = 0  # streams that have had text and not ended, now
    streaming_at_fault: int | None = None  # None: no fault
    streams_began: asyncio.Event = field(default_factory=asyncio.Event)  # STREAMING_AT_FAULT reached
    wall_s: float = 0.0
    examples: list[str] = field(default_factory=list)

    @property
    def error_share(self) -> float:
        return self.counts["error"] / self.streams if self.streams else 0.0

    def line(self) -> str:
        counts = "  ".join(f"{name} {self.counts[name]:>4}" for name in OUTCOMES)
        return (
            f"{self.scenario:<34} streams {self.streams:>4}  {counts}  logprobs exact {self.logprobs_exact:>3} (later run {self.logprobs_resumed:>2})  "
            f"streaming at fault {'-' if self.streaming_at_fault is None else self.streaming_at_fault:>3}  max gap {self.max_gap_s:4.1f} s  wall {self.wall_s:5.1f} s"
        )


def sdk_client(base_url: str, concurrency: int = IN_FLIGHT) -> openai.AsyncOpenAI:
    """An AsyncOpenAI that keeps a connection alive for each stream (the SDK default keeps 100)."""
    limits = httpx2.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key="unused",
        timeout=httpx2.Timeout(60.0, connect=10.0),
        http_client=openai.DefaultAsyncHttpx2Client(limits=limits),
    )


async def one_stream(client: openai.AsyncOpenAI, case: StreamCase, tally: Tally) -> str:
    """Run one streamed chat completion and return its outcome (one of :data:`OUTCOMES`)."""
    last = time.monotonic()
    try:
        stream = await asyncio.wait_for(
            client.chat.completions.create(
                model=case.model,
                messages=[{"role": "user", "content": case.content}],
                max_tokens=case.max_tokens,
                stream=True,
                extra_body=case.extra_body,
            ),
            HUNG_AFTER_S,
        )
    except TimeoutError:
        return "hung"
    except openai.APIConnectionError:
        return "broken"
    except openai.APIError:
        return "error"
    text: list[str] = []
    finish: str | None = None
    streaming = False
    try:
        chunks = aiter(stream)
        while True:
            try:
                chunk = await asyncio.wait_for(anext(chunks), HUNG_AFTER_S)
            except StopAsyncIteration:
                break
            now = time.monotonic()
            tally.max_gap_s = max(tally.max_gap_s, now - last)
            last = now
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
            if not streaming and any(text):
                streaming = True
                tally.streaming += 1
                if tally.streaming >= STREAMING_AT_FAULT:
                    tally.streams_began.set()
    except TimeoutError:
        return "hung"
    except (openai.APIConnectionError, httpx2.HTTPError):
        return "broken"
    except openai.APIError:
        return "error"
    finally:
        tally.streaming -= streaming
        await stream.close()
    if finish is None:
        return "broken"
    got = "".join(text)
    if finish == "length" and got == case.expected:
        return "exact"
    if len(tally.examples) < 3:
        tally.examples.append(difference(case.content, case.max_tokens, f"finish={finish}", got, case.expected))
    return "corrupt"


async def one_library_stream(client: DpcoordClient, case: StreamCase, tally: Tally) -> str:
    """Run one stream asking for log-probabilities through the client library; its outcome."""
    assert case.logprobs is not None
    last = time.monotonic()
    streamed: list[str] = []
    streamed_logprobs: list[float] = []
    final: Final | None = None
    streaming = False
    attempt = 0
    sampling: dict[str, Any] = {"max_tokens": case.max_tokens, "logprobs": LOGPROBS_K, **(case.extra_body or {})}
    replies = client.stream(messages=[ChatMessage("user", case.content)], model=case.model, timeout=60, **sampling)
    try:
        while True:
            try:
                reply = await asyncio.wait_for(anext(replies), HUNG_AFTER_S)
            except StopAsyncIteration:
                break
            now = time.monotonic()
            tally.max_gap_s, last = max(tally.max_gap_s, now - last), now
            if isinstance(reply, Final):
                final = reply
                continue
            streamed.append(reply.text)
            streamed_logprobs += reply.token_logprobs or ()
            attempt = max(attempt, reply.attempt)
            if not streaming and reply.text:
                streaming = True
                tally.streaming += 1
                if tally.streaming >= STREAMING_AT_FAULT:
                    tally.streams_began.set()
    except TimeoutError:
        return "hung"
    except ClientError:
        return "error"
    finally:
        tally.streaming -= streaming
        await replies.aclose()
    if final is None:
        return "broken"
    text = "".join(streamed)
    got = final.token_logprobs or []
    checks = {
        "text": final.finish_reason == "length" and final.generated_text == case.expected,
        "partials' text": case.expected.startswith(text),
        "logprobs": case.logprobs.matches(final),
        # Within the tolerance: a stream run again from its start (its owner replica lost before
        # an engine's handover, say) gives the same greedy tokens, its final the new run's logprobs.
        "partials' logprobs": len(got) >= len(streamed_logprobs)
        and all(abs(a - b) <= case.logprobs.tolerance for a, b in zip(got, streamed_logprobs, strict=False)),
    }
    if all(checks.values()):
        tally.logprobs_exact += 1
        tally.logprobs_resumed += attempt > 0
        return "exact"
    if len(tally.examples) < 3:
        failed = ", ".join(name for name, ok in checks.items() if not ok)
        tolerance = case.logprobs.tolerance
        at = next(
            (n for n, (a, b) in enumerate(zip(got, streamed_logprobs, strict=False)) if abs(a - b) > tolerance), None
        )
        where = "" if at is None else f" (token {at}: final {got[at]!r}, partial {streamed_logprobs[at]!r})"
        label = f"finish={final.finish_reason} attempt={attempt}: {failed} differ{where}"
        tally.examples.append(difference(case.content, case.max_tokens, label, final.generated_text, case.expected))
    return "corrupt"


def difference(content: str, max_tokens: int, label: str, got: str, expected: str) -> str:
    """Where a corrupt stream leaves the expected text, with a little of either side."""
    at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected)))
    start = max(0, at - 20)
    return (
        f"{content!r} max_tokens={max_tokens} {label}: {len(got)} characters for {len(expected)}, "
        f"apart from {at}: got {got[start : at + 40]!r}, want {expected[start : at + 40]!r}"
    )


async def faults_once_streaming(faults: Sequence[Fault], tally: Tally) -> None:
    """Inject ``faults`` one after the other once :data:`STREAMING_AT_FAULT` streams have begun.

    On this machine the clients, not the engines, are the bottleneck: an engine finishes a
    stream's tokens well before the SDK has read them, so the engines are busy mostly while the
    first 200 streams start. Striking as their text begins to arrive meets requests
    mid-generation on every engine and replica (the queue group and the routing spread them
    over all). A replica's status is no guide to the moment: under this load it answers late
    (it showed requests in flight that had long ended)."""
    if not faults:
        return
    await asyncio.wait_for(tally.streams_began.wait(), STREAMING_WAIT_S)
    tally.streaming_at_fault = tally.streaming
    for fault in faults:
        await fault()


async def run_load(
    stack: ChaosStack,
    scenario: str,
    streams: int,
    faults: Sequence[Fault],
    in_flight: int = IN_FLIGHT,
    case: Callable[[str, int], StreamCase] = echo_case,
) -> Tally:
    """``streams`` streamed chat completions (``case(scenario, index)`` each), ``in_flight`` at
    a time, through the stack's gateway (those asking for log-probabilities through the client
    library), with ``faults`` injected beside them (:func:`faults_once_streaming`)."""
    tally = Tally(scenario, streams)
    slots = asyncio.Semaphore(in_flight)
    started = time.monotonic()
    async with sdk_client(stack.base_url, in_flight) as client, await DpcoordClient.connect(stack.settings) as library:

        async def one(index: int) -> None:
            async with slots:
                asked = case(scenario, index)
                if asked.logprobs is None:
                    tally.counts[await one_stream(client, asked, tally)] += 1
                else:
                    tally.counts[await one_library_stream(library, asked, tally)] += 1

        await asyncio.gather(faults_once_streaming(faults, tally), *(one(index) for index in range(streams)))
    tally.wall_s = time.monotonic() - started
    return tally


async def report(stack: ChaosStack, tally: Tally, lines: list[str]) -> None:
    """Print the scenario's line (and, for diagnosis, the live replicas' counters summed) and
    check it against the targets."""
    line = tally.line()
    lines.append(line)
    print(f"\n[chaos] {line}")
    for example in tally.examples:
        print(f"[chaos]   corrupt: {example}")
    counters = await stack.replica_counters()
    print(f"[chaos]   live replicas' counters: {dict(sorted((k, v) for k, v in counters.items() if v))}")
    assert sum(tally.counts.values()) == tally.streams
    assert tally.counts["corrupt"] == 0, tally.examples
    assert tally.counts["hung"] == 0 and tally.counts["broken"] == 0, line
    assert tally.error_share <= MAX_ERROR_SHARE, line


async def kill_and_restart_a_replica(stack: ChaosStack) -> None:
    """SIGKILL a replica (each owns about a third of the requests) and start a new one."""
    stack.kill_replica(stack.live(stack.replicas)[0])
    stack.start_replica()


async def kill_an_engine(stack: ChaosStack) -> None:
    """SIGKILL an engine (each runs about a third); the stack gets a new one before the next test."""
    stack.kill_engine(stack.live(stack.engines)[0])


async def restart_nats(stack: ChaosStack) -> None:
    await stack.restart_nats()
