"""Stalled readers for the chaos suite (tests/faults/test_chaos.py): streams whose readers stop
while faults strike beside them.

- **Library readers**: streams of the client library (:class:`StalledReaders`) that read their
  first reply and then nothing, with a bound of :data:`BUFFER_BYTES`, so each is held in its
  engine within a second (the chaos engines stream sixteen tokens a partial at 5 ms a token).
  Once the faults are over they read again, to the end, and each is counted once: ``exact``
  (its final is the echo engine's text and its partials add up to it), ``corrupt``, ``error``
  (a clear error: an error reply, a timeout, a stall) or ``hung`` (nothing for
  :data:`~tests.faults.chaos_load.HUNG_AFTER_S`).
- **HTTP readers**: gateway streams opened and never read, closed at the end: what they hold
  must not disturb the load beside them.

Whether the engines hold them is read from their Services API status: the counters ``holds``
and ``releases`` (engines/requests.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from types import TracebackType

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from service.client import ClientError, DpcoordClient, FlowLimits
from service.protocol.messages import Final, Partial
from tests.faults.chaos import MODEL, ChaosStack, echo_text
from tests.faults.chaos_load import HUNG_AFTER_S

BUFFER_BYTES = 2048  # some nine partials of sixteen tokens
STALLED_TOKENS = 600  # 3 s at 5 ms a token
HTTP_TOKENS = 2000
READ_AGAIN_TIMEOUT_S = 120.0  # the requests' own deadline: they wait out the faults


class StalledReaders:
    """``library`` stalled library streams and ``http`` stalled gateway streams, open inside
    ``async with``; :meth:`held` waits until the engines hold the library streams, and
    :meth:`read_again` lets them read to their end and counts their outcomes."""

    def __init__(self, stack: ChaosStack, library: int, http: int) -> None:
        self._stack = stack
        self._library = library
        self._http = http
        self._go_on = asyncio.Event()
        self._first: list[asyncio.Event] = []
        self._tasks: list[asyncio.Future[str]] = []
        self._sockets: list[socket.socket] = []
        self._client: DpcoordClient | None = None

    async def __aenter__(self) -> StalledReaders:
        self._client = await DpcoordClient.connect(self._stack.settings)
        for index in range(self._library):
            first = asyncio.Event()
            self._first.append(first)
            self._tasks.append(asyncio.ensure_future(self._read(self._client, index, first)))
        await asyncio.wait_for(asyncio.gather(*(first.wait() for first in self._first)), 30)
        self._sockets = [self._open_http(index) for index in range(self._http)]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sock in self._sockets:
            sock.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    async def held(self, timeout_s: float = 30.0) -> int:
        """Wait until the live engines hold (holds less releases) every library stream."""
        nc = await self._stack.connect()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while True:  # remote state (engine counters): nothing to wait on but the next answers
                held = await self._held_now(nc)
                if held >= self._library or loop.time() > deadline:
                    return held
                await asyncio.sleep(0.1)
        finally:
            await nc.close()

    async def read_again(self) -> Counter[str]:
        self._go_on.set()
        return Counter(await asyncio.gather(*self._tasks))

    async def _held_now(self, nc: NATS) -> int:
        held = 0
        for engine_id in self._stack.live(self._stack.engines):
            try:
                counters = (await self._stack.status(nc, "engine", engine_id))["counters"]
            except (NatsError, TimeoutError):
                continue
            held += counters.get("holds", 0) - counters.get("releases", 0)
        return held

    async def _read(self, client: DpcoordClient, index: int, first: asyncio.Event) -> str:
        prompt = f"stalled reader {index:03d} "
        stream = client.stream(
            prompt,
            max_tokens=STALLED_TOKENS,
            flow=FlowLimits(BUFFER_BYTES, READ_AGAIN_TIMEOUT_S),
            timeout=READ_AGAIN_TIMEOUT_S,
        )
        streamed: list[str] = []
        loop = asyncio.get_running_loop()
        quiet: asyncio.Timeout | None = None  # after reading again: no reply for HUNG_AFTER_S is a hang
        try:
            replies = aiter(stream)
            reply = await anext(replies)
            first.set()
            await self._go_on.wait()
            async with asyncio.timeout(HUNG_AFTER_S) as quiet:
                while not isinstance(reply, Final):
                    streamed.append(reply.text if isinstance(reply, Partial) else "")
                    quiet.reschedule(loop.time() + HUNG_AFTER_S)
                    reply = await anext(replies)
        except TimeoutError:
            return "hung" if quiet is not None and quiet.expired() else "error"
        except (ClientError, StopAsyncIteration):
            return "error"
        finally:
            first.set()
            await stream.aclose()
        want = echo_text(prompt, STALLED_TOKENS)
        return "exact" if reply.generated_text == want and "".join(streamed) == want else "corrupt"

    def _open_http(self, index: int) -> socket.socket:
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"stalled http {index}"}],
                "max_tokens": HTTP_TOKENS,
                "stream": True,
            }
        ).encode()
        sock = socket.create_connection(("127.0.0.1", self._stack.gateway_port))
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: chaos\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        return sock
