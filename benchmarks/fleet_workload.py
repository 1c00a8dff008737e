"""The fleet-size benchmark's requests: client-library envelopes around one short body, each
carrying the prefix hashes of a long prompt that shares one of 8 system prompts."""

from __future__ import annotations

import random
import uuid

from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitEnvelope, SubmitRequest
from service.protocol.prefix import prefix_hashes


class Workload:
    """Envelopes with unique client_request_ids over one short body, each with the prefix
    hashes of one of 8 shared system prompts plus its own tail (64 tails, reused)."""

    def __init__(self, seed: int = 1) -> None:
        rng = random.Random(seed)
        self._body = encode_msgpack(SubmitRequest(list(range(1, 11)), SamplingParams(max_tokens=1)))
        systems = [[rng.randrange(32000) for _ in range(1024)] for _ in range(8)]
        self._hashes = [
            prefix_hashes(systems[index % 8] + [rng.randrange(32000) for _ in range(32)]) for index in range(64)
        ]
        self._client_id = f"fleet-{uuid.uuid4().hex[:8]}"

    def __call__(self, number: int) -> bytes:
        hashes = self._hashes[number % len(self._hashes)]
        return encode_msgpack(SubmitEnvelope(1, self._body, False, number, self._client_id, None, None, None, hashes))
