"""Garbage-collector settings for the long-running services (coordinator, engines, gateway).

Every request allocates a few short-lived objects the collector tracks (coroutines, request
table entries, timers). With CPython's default generation-0 threshold of 700 the collector
runs every hundred requests or so and walks whatever is young and alive each time, a
measurable share of the per-request cost (docs/performance.md). A threshold of 10,000 makes
those runs 14 times rarer at the same cost each. Objects alive at startup are
frozen out of every later sweep. Reference counting still frees almost everything at once;
only cycles wait longer.

A service calls :func:`tune_for_throughput` once, when what it keeps for its life is built
(its modules, its app and settings), so those objects are the ones frozen. The gateway's
baselines in ``dpcoord bench --gateway`` (benchmarks/hello_asgi.py) call it too, so the bare
app and the gateway run with the same collector settings.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000


def tune_for_throughput() -> None:
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
