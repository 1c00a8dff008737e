"""The gateway as a public HTTP edge, probed as an attacker would: header bytes and count (431),
a head that never comes or trickles in (closed, 408), a body that trickles in (408), too many
connections (503), the API key checked before the body is read, and every malformed body a 400
(or 415) in OpenAI's shape naming the field: too-deep nesting, integers beyond 64 bits, an
oversized model name, a wrong Content-Type; and a multi-prompt stream whose choice fails after
the stream began ends with an error event and ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from service.coordinator.coordinator import Coordinator
from service.gateway.auth import ApiKeys
from service.gateway.schemas import completion_decoder
from service.gateway.streaming import ChunkWriter, Replies, sse_events
from service.gateway.translate import completion_plan
from service.ops.settings import Settings
from service.protocol.messages import Final, Partial
from tests.conftest import EngineFactory
from tests.gateway_helpers import Served, http, serve_gateway, sse_data

ECHO = "dpcoord-echo"
BOUNDS = {"gateway_read_timeout_s": 0.5, "gateway_max_header_bytes": 4096, "gateway_max_headers": 20}


@pytest.fixture
async def gateway(settings: Settings, coordinator: Coordinator) -> AsyncIterator[Served]:
    async with serve_gateway(settings.model_copy(update=BOUNDS)) as served:
        yield served


async def _exchange(port: int, data: bytes, pause_s: float = 0.0, pieces: int = 1) -> tuple[bytes, bool]:
    """Send ``data`` (in ``pieces``, ``pause_s`` apart) while reading until the server closes;
    what it answered, and whether all of ``data`` was sent before that."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = bytearray()

    async def read() -> None:
        while chunk := await reader.read(65536):
            answer.extend(chunk)

    reading = asyncio.ensure_future(read())
    size = max(1, len(data) // pieces)
    sent_all = True
    try:
        for start in range(0, len(data), size):
            if reading.done():
                sent_all = False
                break
            writer.write(data[start : start + size])
            await writer.drain()
            if pause_s:
                await asyncio.sleep(pause_s)
        await asyncio.wait_for(reading, 10)
    except ConnectionError:
        sent_all = False
        await asyncio.wait_for(asyncio.wait([reading]), 10)
    finally:
        writer.close()
    return bytes(answer), sent_all


def _status_and_error(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


async def test_a_header_over_the_byte_cap_is_431_without_reading_it_all(gateway: Served) -> None:
    """A 4 MB header against a 4 KB cap: refused once the cap is passed, the rest never read."""
    data = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (4 << 20) + b"\r\n\r\n"
    answer, sent_all = await _exchange(gateway.port, data, pieces=64)
    status, error = _status_and_error(answer)
    assert status == 431 and error["code"] == "request_header_fields_too_large"
    assert not sent_all or b"connection: close" in answer
    assert (await http(gateway.port, "GET", "/healthz")).status == 200


async def test_too_many_header_fields_are_431(gateway: Served) -> None:
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(40))
    answer, _ = await _exchange(gateway.port, b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + fields + b"\r\n")
    assert _status_and_error(answer)[0] == 431


async def test_a_silent_connection_is_closed(gateway: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server, after read_timeout_s
    writer.close()


async def test_a_head_trickling_in_is_408_however_steady(gateway: Served) -> None:
    """Slowloris: a byte every 50 ms keeps arriving, but the head is due 0.5 s after the first."""
    data = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200
    answer, _ = await _exchange(gateway.port, data, pause_s=0.05, pieces=len(data))
    status, error = _status_and_error(answer)
    assert status == 408 and error["code"] == "request_timeout"


async def test_a_body_trickling_in_is_408(gateway: Served, start_engines: EngineFactory) -> None:
    await start_engines(1)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    answer, _ = await _exchange(gateway.port, head + b'{"model"', pause_s=0.0)
    assert _status_and_error(answer)[0] == 408


async def test_connections_beyond_the_cap_get_503(settings: Settings, coordinator: Coordinator) -> None:
    async with serve_gateway(settings.model_copy(update={"gateway_max_connections": 3})) as served:
        held = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(3)]
        try:
            answer, _ = await _exchange(served.port, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            status, error = _status_and_error(answer)
            assert status == 503 and error["code"] == "too_many_connections"
        finally:
            for _, writer in held:
                writer.close()


async def test_the_api_key_is_checked_before_the_body_is_read(settings: Settings, coordinator: Coordinator) -> None:
    """A 1 GB body announced without a key: 401 at once, the body never awaited."""
    async with serve_gateway(settings, ApiKeys(["k"])) as served:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        answer, _ = await _exchange(served.port, head + b"{")
        assert _status_and_error(answer)[0] == 401


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
        ({"prompt": "hi", "seed": 2**64}, "seed"),
        ({"prompt": "hi", "n": 2**70}, "n"),
        ({"prompt": [[104, 105], [2**64]], "stream": True}, "prompt"),
        ({"prompt": [104, 2**40]}, "prompt"),
        ({"prompt": "hi", "model": "m" * 100_000}, "model"),
        ({"prompt": "hi", "bogus": 1}, "bogus"),
        ({"prompt": "hi", "stream_options": {"include_usage": True, "other": 1}}, "stream_options.other"),
    ],
)
async def test_malformed_bodies_are_400_naming_the_field(
    gateway: Served, start_engines: EngineFactory, payload: dict[str, Any], param: str
) -> None:
    await start_engines(1)
    response = await http(gateway.port, "POST", "/v1/completions", {"model": ECHO, **payload})
    assert response.status == 400, response.body[:300]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


async def test_too_deep_nesting_is_400_naming_the_field(gateway: Served) -> None:
    body = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = await http(gateway.port, "POST", "/v1/completions", body=body)
    assert response.status == 400 and response.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
async def test_a_body_that_is_not_json_is_415(gateway: Served, content_type: str) -> None:
    body = json.dumps({"model": ECHO, "prompt": "hi"}).encode()
    response = await http(gateway.port, "POST", "/v1/completions", body=body, headers={"Content-Type": content_type})
    assert response.status == 415 and response.json()["error"]["param"] == "content-type"


class ScriptedClient:
    """A test double of the client library for one multi-prompt stream: choice 0 streams a partial
    and then waits; choice 1 fails once that partial is out, as an engine failing mid-stream would."""

    def __init__(self) -> None:
        self.first_out = asyncio.Event()

    async def stream_batches(self, **submission: Any) -> AsyncGenerator[list[Partial | Final], None]:
        rid = submission["client_request_id"]
        if rid.endswith("-0"):
            yield [Partial(rid, rid, [104], "h")]
            self.first_out.set()
            await asyncio.Event().wait()  # never ends by itself
        await self.first_out.wait()
        raise ValueError("an engine failed")  # any exception, not only the client library's own


async def test_a_failing_choice_of_a_started_stream_is_an_error_event_then_done() -> None:
    client = ScriptedClient()
    plan = completion_plan(completion_decoder.decode(b'{"model": "m", "prompt": ["a", "b"], "stream": true}'))
    replies = Replies((job, client.stream_batches(client_request_id=f"{plan.id}-{job.index}")) for job in plan.jobs)
    first = await replies.batch()
    events = [event async for event in sse_events(ChunkWriter(plan, chat=False), first, replies)]
    await replies.aclose()
    data = sse_data(b"".join(events))
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    assert json.loads(data[0])["choices"][0]["text"] == "h"
    assert json.loads(data[-2])["error"]["type"] == "internal_error"
