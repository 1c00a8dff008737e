"""The benchmark client: one nats-py connection driving one target at a time.

The same client code drives the raw baselines and dpcoord, so a ratio measures what lies
behind the subject, not the client. Bodies are encoded once; replies are not decoded in the
timed loops (an error reply is spotted by its ``error`` type string, which a final never holds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from benchmarks.proc_cpu import cpu_seconds

_ERROR_MARK = b"error"


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request goes and what it carries; ``body()`` gives the next request's body."""

    subject: str
    body: Callable[[], bytes]


@dataclass(slots=True)
class Window:
    """Counts and CPU seconds of watched processes over one measured interval."""

    completed: int
    seconds: float
    cpu: dict[str, float] = field(default_factory=dict)
    errors: int = 0

    @property
    def rate(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0

    def cpu_us_per(self, name: str) -> float:
        return self.cpu[name] / self.completed * 1e6 if self.completed else float("nan")


class _Meter:
    """Snapshots a counter and the watched processes' CPU time at the window's edges."""

    def __init__(self, count: Callable[[], int], watch: Mapping[str, int]) -> None:
        self._count = count
        self._watch = watch
        self._start = (0, 0.0, {})  # type: tuple[int, float, dict[str, float]]

    def _now(self) -> tuple[int, float, dict[str, float]]:
        return self._count(), time.perf_counter(), {name: cpu_seconds(pid) for name, pid in self._watch.items()}

    def begin(self) -> None:
        self._start = self._now()

    def end(self) -> Window:
        count, clock, cpu = self._now()
        start_count, start_clock, start_cpu = self._start
        return Window(count - start_count, clock - start_clock, {name: cpu[name] - start_cpu[name] for name in cpu})


async def sequential(
    nc: NATS, target: Target, count: int, watch: Mapping[str, int], timeout: float = 10.0
) -> tuple[list[float], Window]:
    """Latencies in microseconds of ``count`` requests sent one after another, and their window."""
    latencies: list[float] = []
    errors = 0
    meter = _Meter(lambda: len(latencies), watch)
    meter.begin()
    for _ in range(count):
        body = target.body()
        start = time.perf_counter_ns()
        msg = await nc.request(target.subject, body, timeout=timeout)
        latencies.append((time.perf_counter_ns() - start) / 1000)
        errors += _ERROR_MARK in msg.data
    window = meter.end()
    window.errors = errors
    return latencies, window


async def pipelined(
    nc: NATS,
    target: Target,
    inflight: int,
    warmup_s: float,
    duration_s: float,
    watch: Mapping[str, int],
    timeout: float = 30.0,
) -> Window:
    """Requests per second with ``inflight`` requests outstanding at all times (one nats-py request each)."""
    done = 0
    errors = 0
    running = True

    async def worker() -> None:
        nonlocal done, errors
        while running:
            msg = await nc.request(target.subject, target.body(), timeout=timeout)
            done += 1
            errors += _ERROR_MARK in msg.data

    meter = _Meter(lambda: done, watch)
    workers = [asyncio.ensure_future(worker()) for _ in range(inflight)]
    try:
        await asyncio.sleep(warmup_s)
        meter.begin()
        errors_before = errors
        await asyncio.sleep(duration_s)
        window = meter.end()
        window.errors = errors - errors_before
    finally:
        running = False
        await asyncio.gather(*workers)
    return window


async def streaming(
    nc: NATS, target: Target, inflight: int, warmup_s: float, duration_s: float, watch: Mapping[str, int]
) -> Window:
    """Streamed messages per second (every message but the final and the closing empty one).

    Each stream's messages arrive on one wildcard inbox subscription; a stream closed by its
    empty message is replaced by a new one, so ``inflight`` streams run at all times."""
    inbox = nc.new_inbox()
    received = 0
    finished = 0
    errors = 0
    ids = iter(range(1 << 62))
    running = True
    all_closed = asyncio.Event()
    open_streams = 0

    async def launch() -> None:
        nonlocal open_streams
        open_streams += 1
        await nc.publish(target.subject, target.body(), reply=f"{inbox}.{next(ids)}")

    async def on_message(msg: Msg) -> None:
        nonlocal received, finished, errors, open_streams
        data = msg.data
        if data:
            received += 1
            errors += _ERROR_MARK in data
            return
        finished += 1
        open_streams -= 1
        if running:
            await launch()
        elif open_streams == 0:
            all_closed.set()

    sub = await nc.subscribe(f"{inbox}.*", cb=on_message, pending_msgs_limit=-1, pending_bytes_limit=-1)
    # Partials relayed = messages received minus one final per finished stream.
    meter = _Meter(lambda: received - finished, watch)
    try:
        for _ in range(inflight):
            await launch()
        await asyncio.sleep(warmup_s)
        meter.begin()
        errors_before = errors
        await asyncio.sleep(duration_s)
        window = meter.end()
        window.errors = errors - errors_before
        running = False
        await asyncio.wait_for(all_closed.wait(), 60)
    finally:
        running = False
        await sub.unsubscribe()
    return window
