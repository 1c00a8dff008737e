"""The coordinator benchmark's request bodies: plain contract bodies, as a program without the
client library sends them, and the client library's envelopes around them."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitEnvelope, SubmitRequest


def submission(prompt: list[int], max_tokens: int, stream: bool = False) -> bytes:
    """A plain contract body, as a program without the client library (or `nats pub`) sends it."""
    return encode_msgpack(SubmitRequest(prompt, SamplingParams(max_tokens=max_tokens), stream))


class Enveloped:
    """The client library's wire format: each request an envelope with its own client_request_id
    (named client, so the coordinator does its idempotency bookkeeping) around one encoded body."""

    def __init__(self, body: bytes, stream: bool, client_id: str) -> None:
        self._body = body
        self._stream = stream
        self._client_id = client_id
        self._ids = itertools.count()

    def __call__(self) -> bytes:
        return encode_msgpack(SubmitEnvelope(1, self._body, self._stream, next(self._ids), self._client_id))


def constant(body: bytes) -> Callable[[], bytes]:
    return lambda: body


def long_prompt(tokens: int, seed: int = 7) -> list[int]:
    """Token ids drawn from a 32k vocabulary: about 3 bytes each in msgpack."""
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(tokens)]


@dataclass(slots=True)
class Bodies:
    short: bytes
    long: bytes
    stream: bytes
