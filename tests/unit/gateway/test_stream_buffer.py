"""A stream whose HTTP client stops reading (service/gateway/streaming.py with the client
library's flow control, service/client/flow.py): the gateway stops taking its replies, they wait
in the submission's mailbox up to the bound, the request is held there, and released once the
client reads again, with every event exact and in order.

No NATS and no HTTP server here: the ASGI ``send`` is a test double that blocks while the
client does not read, the engine is ``HoldingEngine``, a test double that publishes partials
into the client's inbox as fast as it can and honours holds, and the holds go to
``FlowRecorder`` (tests/unit/client/test_flow.py). The real stack is
tests/integration/test_slow_readers.py."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncGenerator, Callable, MutableMapping
from typing import Any

from service.client.exchanges import CoordinatorWatch, Exchanges
from service.client.flow import FlowControl, FlowLimits
from service.client.submission import Submission
from service.gateway.disconnects import DisconnectWatch
from service.gateway.schemas import completion_decoder
from service.gateway.streaming import DONE, ChunkWriter, Replies, send_stream, sse_events
from service.gateway.translate import Job, completion_plan
from service.protocol.codec import encode_msgpack
from service.protocol.messages import Final, Partial
from tests.unit.client.test_flow import ENVELOPE, REQUEST_ID, FlowRecorder
from tests.unit.client.test_submission import Published

LIMIT = 16 * 1024
TOKENS = 3000


class HoldingEngine:
    """Test double of an engine: one partial per token, into the client's inbox, skipping its
    steps while the last hold it got says held."""

    def __init__(self, exchanges: Exchanges, subject: str, recorder: FlowRecorder) -> None:
        self._exchanges = exchanges
        self._subject = subject.encode()
        self._recorder = recorder
        self.generated = 0
        self.steps_skipped = 0

    @property
    def held(self) -> bool:
        return bool(self._recorder.holds) and self._recorder.holds[-1][1]

    async def run(self) -> None:
        while self.generated < TOKENS:
            await asyncio.sleep(0)
            if self.held:
                self.steps_skipped += 1
                continue
            n = self.generated
            self.generated += 1
            body = encode_msgpack(Partial(REQUEST_ID, "r1", [n], chr(97 + n % 26), offset=n))
            self._exchanges.on_inline(self._subject, body, None)
        text = "".join(chr(97 + n % 26) for n in range(TOKENS))
        final = Final(REQUEST_ID, "r1", "e1", list(range(TOKENS)), text, "length")
        self._exchanges.on_inline(self._subject, encode_msgpack(final), None)
        self._exchanges.on_inline(self._subject, b"", None)


class SlowReceiver:
    """Test double of the HTTP side of ASGI: ``send`` blocks while the client reads nothing."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()
        self.body = bytearray()
        self.waiting = asyncio.Event()  # a send is blocked

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if not self.reading.is_set():
            self.waiting.set()
            await self.reading.wait()
        if message["type"] == "http.response.body":
            self.body += message["body"]

    async def receive(self) -> MutableMapping[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")


async def batches(submission: Submission) -> AsyncGenerator[list[Partial | Final], None]:
    """The client library's stream_batches, without its NATS client."""
    try:
        while replies := await submission.replies():
            yield replies
            if isinstance(replies[-1], Final):
                return
    finally:
        submission.close()


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


async def test_a_client_that_stops_reading_holds_its_stream_within_the_bound_and_gets_it_all_when_it_reads() -> None:
    recorder, published, exchanges = FlowRecorder(), Published(), Exchanges()
    exchanges.inbox = "_INBOX.gw"
    flow = FlowControl(FlowLimits(LIMIT, 60.0), recorder)
    submission = Submission(published, exchanges, CoordinatorWatch(exchanges, 1.0, 3.0), ENVELOPE, 60.0, flow)
    await submission.start()
    [mailbox] = exchanges.queues.values()
    engine = HoldingEngine(exchanges, published.subjects[0], recorder)
    generating = asyncio.ensure_future(engine.run())

    plan = completion_plan(completion_decoder.decode(json.dumps({"model": "m", "prompt": "p", "stream": True})))
    replies = Replies([(Job(0, prompt="p"), batches(submission))])
    writer = ChunkWriter(plan, chat=False)
    receiver = SlowReceiver()
    watch = DisconnectWatch(receiver.receive, lambda: asyncio.sleep(0, True))
    events = sse_events(writer, await replies.batch(), replies)
    writing = asyncio.ensure_future(send_stream(receiver.send, events, watch))

    await asyncio.wait_for(receiver.waiting.wait(), 10.0)  # the client reads nothing
    await wait_for(lambda: engine.held)
    await wait_for(lambda: engine.steps_skipped > 100)
    held_at = engine.generated
    assert held_at < TOKENS // 2  # the engine stopped long before the end
    assert LIMIT < mailbox.unread < LIMIT + LIMIT // 4  # what waits in the gateway is bounded
    skipped = engine.steps_skipped
    await wait_for(lambda: engine.steps_skipped > skipped + 100)
    assert engine.generated == held_at  # held: a hundred steps more, not a token more

    receiver.reading.set()  # the client reads again
    await asyncio.wait_for(writing, 10.0)
    await generating
    assert [held for _, held, _ in recorder.holds][:2] == [True, False]
    assert [seq for _, _, seq in recorder.holds] == list(range(1, len(recorder.holds) + 1))
    texts = [
        json.loads(line[len(b"data: ") :])["choices"][0]["text"]
        for line in bytes(receiver.body).split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert "".join(texts) == "".join(chr(97 + n % 26) for n in range(TOKENS))
    assert bytes(receiver.body).endswith(DONE)
    await replies.aclose()


async def test_the_choices_of_a_request_stop_being_taken_while_the_stream_is_not_read() -> None:
    taken = [0, 0]

    async def endless(index: int) -> AsyncGenerator[list[Partial | Final], None]:
        for n in itertools.count():
            taken[index] += 1
            yield [Partial(REQUEST_ID, "r1", [n], "x", offset=n)]

    replies = Replies([(Job(0), endless(0)), (Job(1), endless(1))])
    for _ in range(50):
        await asyncio.sleep(0)
    assert max(taken) <= 3  # the queue holds as many lists as there are choices, then the pumps wait
    assert len(await replies.batch()) <= 2
    await asyncio.wait_for(replies.aclose(), 5.0)  # pumps blocked on the full queue still close
