"""An open-loop load client: requests at a fixed rate, whatever the replies do.

A closed loop (a fixed number of requests in flight) slows down with the system it measures;
an open loop keeps offering the same rate, so the same offered rate can be compared across
fleet sizes and a saturated coordinator shows as an achieved rate below the offered one.
Requests go out in small bursts every ``TICK_S``, as from many clients at once. Each request
has its own reply subject ``<inbox>.<n>``, all on one wildcard subscription, so every reply is
matched to its request: a missing reply is lost, a second one is a duplicate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from benchmarks.proc_cpu import busy_cpu_seconds, cpu_seconds

TICK_S = 0.002
_ERROR_MARK = b"error"


@dataclass(slots=True)
class OfferedLoad:
    offered_per_s: float
    sent: int = 0
    answered: int = 0
    errors: int = 0
    duplicated: int = 0
    lost: int = 0
    window_s: float = 0.0
    window_answered: int = 0
    latencies_us: list[float] = field(default_factory=list)  # of requests sent inside the window
    cpu_s: dict[str, float] = field(default_factory=dict)  # watched processes, over the window
    machine_busy_s: float = 0.0  # every process on the machine, over the window

    @property
    def achieved_per_s(self) -> float:
        return self.window_answered / self.window_s if self.window_s else 0.0

    def cpu_us_per_request(self, name: str) -> float:
        return self.cpu_s[name] / self.window_answered * 1e6 if self.window_answered else float("nan")


async def offer(
    nc: NATS,
    subject: str,
    body: Callable[[int], bytes],
    rate: float,
    warmup_s: float,
    duration_s: float,
    watch: Mapping[str, int],
    drain_s: float = 10.0,
) -> OfferedLoad:
    """Offer ``rate`` requests/s for ``warmup_s + duration_s``; ``body(n)`` is request n's body.
    CPU of ``watch`` (name -> pid) and the answers are counted over the last ``duration_s``."""
    result = OfferedLoad(rate)
    inbox = nc.new_inbox()
    sent_at: dict[int, int] = {}
    measuring = False
    window_first = -1  # numbers of the requests sent inside the window: [window_first, window_last)
    window_last = -1
    all_answered = asyncio.Event()
    sending = True

    async def on_reply(msg: Msg) -> None:
        number = int(msg.subject[len(inbox) + 1 :])
        started = sent_at.pop(number, None)
        if started is None:
            result.duplicated += 1
            return
        result.answered += 1
        result.errors += _ERROR_MARK in msg.data
        if measuring:
            result.window_answered += 1
        if window_first >= 0 and number >= window_first and (window_last < 0 or number < window_last):
            result.latencies_us.append((time.perf_counter_ns() - started) / 1000)
        if not sending and not sent_at:
            all_answered.set()

    sub = await nc.subscribe(f"{inbox}.*", cb=on_reply, pending_msgs_limit=-1, pending_bytes_limit=-1)
    await nc.flush()
    start = time.perf_counter()
    window_start = start + warmup_s
    end = window_start + duration_s
    cpu_start: dict[str, float] = {}
    busy_start = 0.0
    try:
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            if not measuring and now >= window_start:
                measuring, window_first = True, result.sent
                cpu_start = {name: cpu_seconds(pid) for name, pid in watch.items()}
                busy_start = busy_cpu_seconds()
                window_start = now
            due = int((now - start) * rate) - result.sent
            for _ in range(due):
                number = result.sent
                sent_at[number] = time.perf_counter_ns()
                await nc.publish(subject, body(number), reply=f"{inbox}.{number}")
                result.sent += 1
            await asyncio.sleep(TICK_S)
        measuring, window_last = False, result.sent
        result.window_s = time.perf_counter() - window_start
        result.cpu_s = {name: cpu_seconds(pid) - cpu_start[name] for name, pid in watch.items()}
        result.machine_busy_s = busy_cpu_seconds() - busy_start
        sending = False
        if sent_at:
            try:
                await asyncio.wait_for(all_answered.wait(), drain_s)
            except TimeoutError:
                pass
        result.lost = len(sent_at)
    finally:
        await sub.unsubscribe()
    return result
