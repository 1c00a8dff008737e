"""Byte for byte what the `nats` CLI puts on the wire, over a raw TCP socket (no nats-py).

`nats request S BODY` = SUB to an inbox, then PUB S <inbox> with the body as typed;
`-H K:V` turns PUB into HPUB with a NATS/1.0 header block;
`nats request --replies 0 --wait-for-empty` reads until an empty message.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlparse

from service.coordinator.coordinator import Coordinator
from tests.conftest import EngineFactory


class RawNatsClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, url: str) -> RawNatsClient:
        parsed = urlparse(url)
        reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
        await reader.readline()  # INFO {...}
        writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true,"protocol":1}\r\n')
        writer.write(b"PING\r\n")
        await writer.drain()
        assert await reader.readline() == b"PONG\r\n"
        return cls(reader, writer)

    async def send(self, line: bytes, payload: bytes = b"") -> None:
        self.writer.write(line + b"\r\n" + (payload + b"\r\n" if line.startswith((b"PUB", b"HPUB")) else b""))
        await self.writer.drain()

    async def next_payload(self) -> bytes:
        while True:
            line = await asyncio.wait_for(self.reader.readline(), 5)
            if line == b"PING\r\n":
                await self.send(b"PONG")
                continue
            parts = line.split()
            if parts[0] == b"MSG":
                data = await self.reader.readexactly(int(parts[-1]) + 2)
                return data[:-2]
            if parts[0] == b"HMSG":
                total = int(parts[-1])
                header_size = int(parts[-2])
                data = await self.reader.readexactly(total + 2)
                return data[header_size:-2]

    def close(self) -> None:
        self.writer.close()


async def test_nats_request_bytes(nats_url: str, coordinator: Coordinator, start_engines: EngineFactory) -> None:
    await start_engines(1)
    client = await RawNatsClient.connect(nats_url)
    try:
        body = b'{"prompt":"hi","sampling_params":{"max_tokens":2}}'
        await client.send(b"SUB _INBOX.cli1 1")
        await client.send(
            b"PUB %s _INBOX.cli1 %d" % (coordinator.subjects.coordinator("submit_request").encode(), len(body)), body
        )
        reply = json.loads(await client.next_payload())
        assert reply["type"] == "final" and reply["generated_text"] == "hi"
    finally:
        client.close()


async def test_nats_request_with_header_and_wait_for_empty(
    nats_url: str, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(1)
    client = await RawNatsClient.connect(nats_url)
    try:
        body = b'{"prompt":"ok","stream":true,"sampling_params":{"max_tokens":3}}'
        headers = b"NATS/1.0\r\nTrace-Id: abc\r\n\r\n"
        subject = coordinator.subjects.coordinator("submit_request").encode()
        await client.send(b"SUB _INBOX.cli2 2")
        await client.send(
            b"HPUB %s _INBOX.cli2 %d %d" % (subject, len(headers), len(headers) + len(body)), headers + body
        )
        payloads = []
        while payload := await client.next_payload():
            payloads.append(json.loads(payload))
        assert [p["type"] for p in payloads] == ["partial", "partial", "partial", "final"]
    finally:
        client.close()


async def test_nats_request_control_with_empty_body(
    nats_url: str, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    """`nats request dpcoord.pause ''`: an empty body is {} and is answered in JSON."""
    await start_engines(1)
    client = await RawNatsClient.connect(nats_url)
    try:
        await client.send(b"SUB _INBOX.cli3 3")
        await client.send(b"PUB %s _INBOX.cli3 0" % coordinator.subjects.coordinator("pause").encode(), b"")
        assert json.loads(await client.next_payload()) == {
            "type": "ack",
            "signal": "pause",
            "state": "paused",
            "revision": 2,
        }
    finally:
        client.close()
