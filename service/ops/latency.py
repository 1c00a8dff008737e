"""Request latency as the coordinator sees it, counted cheaply on the request path.

prometheus_client's ``Histogram.observe`` takes a lock per call; a request is observed twice
and the coordinator's whole per-request budget is a few microseconds, so observations go
into plain bucket counts (one ``bisect``, two additions) and
``service.ops.metrics`` exports them when Prometheus scrapes.
"""

from __future__ import annotations

import time
from bisect import bisect_left

END_TO_END_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# A request's consecutive tokens, one decode step apart (engines/token_pace.py).
INTER_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class LatencyHistogram:
    """Observations counted into fixed buckets; ``counts[i]`` holds values in (bounds[i-1], bounds[i]]."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must be strictly increasing, got {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def observe_many(self, seconds: float, count: int) -> None:
        """``count`` observations of the same value, at the cost of one."""
        self.counts[bisect_left(self.bounds, seconds)] += count
        self.sum += seconds * count

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus wants them, ending with ``+Inf``."""
        pairs: list[tuple[str, int]] = []
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            pairs.append((repr(bound), total))
        pairs.append(("+Inf", total + self.counts[-1]))
        return pairs


class RequestLatency:
    """End-to-end and time-to-first-token latency, from admission.

    Time to first token is observed when a request's first partial is relayed, so it covers
    streamed requests only: a request that is not streamed has no first token on the wire.
    """

    __slots__ = ("end_to_end", "first_token")

    def __init__(self) -> None:
        self.end_to_end = LatencyHistogram(END_TO_END_BUCKETS)
        self.first_token = LatencyHistogram(FIRST_TOKEN_BUCKETS)

    def observe_first_token(self, admitted_at: float) -> None:
        self.first_token.observe(time.monotonic() - admitted_at)

    def observe_finished(self, admitted_at: float) -> None:
        self.end_to_end.observe(time.monotonic() - admitted_at)
