"""This replica's own stalls: a background loop that slept far longer than it asked was not
running (the process was stopped, say with SIGSTOP, or starved of CPU), so the silence it then
finds of engines and peers is its own, as after a NATS reconnect.

Contract: each loop that judges silence (the fleet's watchdog, the heartbeat) reports each
sleep with :meth:`Stalls.slept`; one that overslept by more than ``threshold_s`` is told to skip
its round, and the stall's listeners hear of it once, whichever loop woke first (they restart
the clocks of engines and peers, and arbitration starts its quiet time again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger(__name__)

Listener = Callable[[], None]


class Stalls:
    def __init__(self, threshold_s: float, counters: Counter[str] | None = None) -> None:
        self.threshold_s = threshold_s
        self._counters: Counter[str] = Counter() if counters is None else counters
        self._listeners: list[Listener] = []
        self._handled_at = 0.0

    def listen(self, *listeners: Listener) -> None:
        """Each listener hears of each stall once (``stalls`` counts them)."""
        self._listeners.extend(listeners)

    async def sleep(self, seconds: float) -> bool:
        """``asyncio.sleep(seconds)``; True when the process stalled meanwhile (:meth:`slept`)."""
        since = time.monotonic()
        await asyncio.sleep(seconds)
        return self.slept(since, seconds)

    def slept(self, since: float, asked_s: float) -> bool:
        """A loop that began ``asyncio.sleep(asked_s)`` at ``since`` (monotonic) woke now: True
        when the process stalled meanwhile, so the loop skips this round."""
        now = time.monotonic()
        stalled_s = now - since - asked_s
        if stalled_s <= self.threshold_s:
            return False
        if since >= self._handled_at:  # another loop that slept through it told them already
            self._handled_at = now
            self._counters["stalls"] += 1
            log.warning("this coordinator stalled for %.1f s: the silence it saw was its own", stalled_s)
            for listener in self._listeners:
                listener()
        return True
