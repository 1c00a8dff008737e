"""Log lines for engines joining and leaving: a fleet of thousands must not write thousands.

The first join (or removal) after a quiet second is logged at once, with its engine id; the
ones that follow are counted and summed into one line a second, for as long as they keep coming.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable


class _Burst:
    """Events of one kind: the first of each interval logged whole, the rest summed."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.window_start = -interval_s
        self.count = 0
        self.in_flight = 0
        self.reasons: Counter[str] = Counter()
        self.last_engine_id = ""
        self.flush_scheduled = False

    def quiet(self, now: float) -> bool:
        return now - self.window_start >= self.interval_s


class FleetLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._joins = _Burst(interval_s)
        self._removals = _Burst(interval_s)
        self._fleet_size = 0

    def joined(self, engine_id: str, model: str | None, capacity: int, fleet_size: int) -> None:
        self._fleet_size = fleet_size
        burst = self._joins
        if self._opens_window(burst, self._flush_joins):
            self._log.info(
                "engine_id=%s joined (model %s, capacity %d, %d engines)", engine_id, model, capacity, fleet_size
            )
            return
        burst.count += 1
        burst.last_engine_id = engine_id

    def removed(self, engine_id: str, reason: str, in_flight: int, fleet_size: int) -> None:
        self._fleet_size = fleet_size
        burst = self._removals
        if self._opens_window(burst, self._flush_removals):
            self._log.warning("engine_id=%s removed (%s); %d requests in flight", engine_id, reason, in_flight)
            return
        burst.count += 1
        burst.last_engine_id = engine_id
        burst.in_flight += in_flight
        burst.reasons[reason] += 1

    def flush(self) -> None:
        """Log what is being summed now rather than when its second is over."""
        self._flush_joins()
        self._flush_removals()

    def _opens_window(self, burst: _Burst, flush: Callable[[], None]) -> bool:
        """True when this event starts a new interval (log it whole); else make sure the
        interval's sum is logged when it ends."""
        now = time.monotonic()
        if burst.quiet(now):
            burst.window_start = now
            return True
        if not burst.flush_scheduled:
            burst.flush_scheduled = True
            asyncio.get_running_loop().call_later(burst.window_start + burst.interval_s - now, flush)
        return False

    def _flush_joins(self) -> None:
        burst = self._joins
        if not burst.count:
            return
        self._log.info(
            "%d more engines joined in the last %g s, the last engine_id=%s (%d engines)",
            burst.count,
            burst.interval_s,
            burst.last_engine_id,
            self._fleet_size,
        )
        _restart(burst)

    def _flush_removals(self) -> None:
        burst = self._removals
        if not burst.count:
            return
        reasons = ", ".join(f"{count} {reason}" for reason, count in burst.reasons.most_common())
        self._log.warning(
            "%d more engines removed in the last %g s (%s), the last engine_id=%s; %d requests in flight; %d engines",
            burst.count,
            burst.interval_s,
            reasons,
            burst.last_engine_id,
            burst.in_flight,
            self._fleet_size,
        )
        burst.reasons.clear()
        burst.in_flight = 0
        _restart(burst)


def _restart(burst: _Burst) -> None:
    """A summed interval just ended: the next one starts now, so a steady stream of events
    keeps being summed, one line a second."""
    burst.window_start = time.monotonic()
    burst.count = 0
    burst.flush_scheduled = False
