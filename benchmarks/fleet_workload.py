"""The fleet-size benchmark's requests: client-library envelopes around one short body, each
carrying the prefix hashes of a long prompt that shares one of 8 system prompts; or, with
``real_prompts`` (engines that publish KV events), around that long prompt itself, so that the
engines hash, hold and evict what the coordinator routes by."""

from __future__ import annotations

import random
import uuid

from service.protocol.codec import encode_msgpack
from service.protocol.messages import SamplingParams, SubmitEnvelope, SubmitRequest
from service.protocol.prefix import prefix_hashes


class Workload:
    """Envelopes with unique client_request_ids over one short body, each with the prefix
    hashes of one of 8 shared system prompts plus its own tail (64 tails, reused); with
    ``real_prompts``, around the long prompt itself, whose tail is the request's own (its first
    two tokens are the request's number), as a real workload's tails are: new to every cache."""

    def __init__(self, seed: int = 1, real_prompts: bool = False) -> None:
        rng = random.Random(seed)
        self._real = real_prompts
        self._body = encode_msgpack(SubmitRequest(list(range(1, 11)), SamplingParams(max_tokens=1)))
        self._systems = [[rng.randrange(32000) for _ in range(1024)] for _ in range(8)]
        self._tails = [[rng.randrange(32000) for _ in range(32)] for _ in range(64)]
        self._hashes = [prefix_hashes(self._systems[index % 8] + self._tails[index]) for index in range(64)]
        self._client_id = f"fleet-{uuid.uuid4().hex[:8]}"

    def __call__(self, number: int) -> bytes:
        index = number % len(self._hashes)
        body, hashes = self._body, self._hashes[index]
        if self._real:
            prompt = [*self._systems[index % 8], number & 0xFFFF, number >> 16, *self._tails[index][2:]]
            body, hashes = encode_msgpack(SubmitRequest(prompt, SamplingParams(max_tokens=1))), prefix_hashes(prompt)
        return encode_msgpack(SubmitEnvelope(1, body, False, number, self._client_id, None, None, None, hashes))
