"""The pace of one engine's generation, for its ``/metrics``: the tokens it generated, and the
time between a request's consecutive tokens (inter-token latency).

A step advances every running request by at most one token (engines/backend.py), so the time
from one step's end to the next is the wait of every request that got a token in both. The
step loop calls :meth:`TokenPace.stepped` with each step's outputs once the previous step's
outputs are recorded on their requests (engines/runtime_steps.py): a request that already
holds tokens waited ``gap`` for this one; a request whose first token this is waited for its
prefill, which is time to first token, and is not counted here. A pause between two steps is
part of the gap: the requests it froze waited that long for their next token.

One observation per step, weighted by the requests it covers: one pass over the step's
outputs, with no clock read or histogram update per request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from engines.backend import TokenOutput
from engines.replies import ActiveRequest
from service.ops.latency import INTER_TOKEN_BUCKETS, LatencyHistogram


class TokenPace:
    __slots__ = ("_last_step", "generated", "inter_token")

    def __init__(self) -> None:
        self.generated = 0
        self.inter_token = LatencyHistogram(INTER_TOKEN_BUCKETS)
        self._last_step: float | None = None

    def stepped(self, outputs: Sequence[TokenOutput], active: Mapping[str, ActiveRequest]) -> None:
        """A step ended with ``outputs``; ``active`` holds the requests as the previous steps left them."""
        now = time.monotonic()
        generated = 0
        continued = 0
        for output in outputs:
            if output.new_tokens:
                generated += len(output.new_tokens)
                request = active.get(output.request_id)
                if request is not None and request.tokens:
                    continued += 1
        self.generated += generated
        if continued and self._last_step is not None:
            self.inter_token.observe_many(now - self._last_step, continued)
        self._last_step = now
