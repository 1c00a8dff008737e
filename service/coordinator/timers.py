"""Coarse timers: ``call_later`` for many timeouts that may fire a little late.

The coordinator gives every request a deadline, and almost every request finishes long
before it. One event-loop timer per request is a noticeable share of the coordinator's
per-request budget to arm and cancel with a few hundred alive (docs/performance.md). Here
timers due in the same ``resolution_s`` slot share one event-loop timer, and arming and
cancelling one is a small object and a set insert and discard. A timer fires at
most ``resolution_s`` late, never early.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any


class CoarseTimer:
    """A handle with ``cancel()``, like :class:`asyncio.TimerHandle`."""

    __slots__ = ("_callback", "_args", "_slot")

    def __init__(self, slot: set[CoarseTimer], callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._slot = slot
        self._callback = callback
        self._args = args

    def cancel(self) -> None:
        self._slot.discard(self)

    def fire(self) -> None:
        self._callback(*self._args)


class CoarseTimers:
    def __init__(self, resolution_s: float = 0.05) -> None:
        if resolution_s <= 0:
            raise ValueError("resolution_s must be positive")
        self.resolution_s = resolution_s
        self._slots: dict[int, set[CoarseTimer]] = {}

    def call_later(self, delay_s: float, callback: Callable[..., Any], *args: Any) -> CoarseTimer:
        loop = asyncio.get_running_loop()
        tick = math.ceil((loop.time() + delay_s) / self.resolution_s)
        slot = self._slots.get(tick)
        if slot is None:
            slot = self._slots[tick] = set()
            loop.call_at(tick * self.resolution_s, self._fire, tick)
        timer = CoarseTimer(slot, callback, args)
        slot.add(timer)
        return timer

    def _fire(self, tick: int) -> None:
        slot = self._slots.pop(tick, set())
        while slot:  # popping one at a time honours a cancel() made by an earlier callback
            slot.pop().fire()

    def __len__(self) -> int:
        return sum(len(slot) for slot in self._slots.values())
