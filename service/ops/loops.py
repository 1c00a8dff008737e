"""Background loops that never die.

Every long-running task of the coordinator and the engine runs its body through
:func:`keep_running`: an iteration that raises is logged (rate-limited, with its traceback),
counted as ``loop_errors_<name>``, followed by a short pause, and the next iteration runs. A
dead heartbeat watchdog or routing task would otherwise fail silently and for good.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import NoReturn

from service.ops.log_limit import RateLimitedLog

log = logging.getLogger(__name__)


async def keep_running(
    name: str, iteration: Callable[[], Awaitable[object]], counters: Counter[str], pause_s: float = 0.05
) -> NoReturn:
    """Await ``iteration()`` again and again, whatever it raises (cancellation ends the loop)."""
    failures = RateLimitedLog(log, per_interval=3, interval_s=10.0)
    while True:
        try:
            await iteration()
        except Exception:
            counters[f"loop_errors_{name}"] += 1
            failures.exception("%s loop: an iteration failed; the loop goes on", name)
            await asyncio.sleep(pause_s)
