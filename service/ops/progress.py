"""Progress of long work in a service: loading a model, digesting and swapping in new weights.

Contract: a :class:`Progress` counts bytes done out of a total (or, with no total, only time)
and shows it where someone can see it: on a terminal (its stream, stderr by default, is a tty)
as one bar redrawn at most every ``redraw_s``, and elsewhere (a pod's log, ``dpcoord up``'s
copy of a part's stderr) as a log line every ``interval_s``, so a long load is never silent
and a log never fills with bars. :meth:`done` ends it with one log line saying how long it took.
It may be advanced from a worker thread (loading runs off the event loop); it costs a clock
reading per call, so callers advance it per tensor or per chunk of megabytes, not per byte.
Work that cannot count its bytes (a swap inside a backend) runs inside :meth:`ticking`, which
shows its time going by.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TextIO

_ERASE_LINE = "\r\x1b[K"
_WIDTH = 30


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


class Progress:
    def __init__(
        self,
        what: str,
        total: int | None,
        log: logging.Logger,
        stream: TextIO | None = None,
        interval_s: float = 5.0,
        redraw_s: float = 0.2,
    ) -> None:
        self.what = what
        self.total = total
        self.done_bytes = 0
        self._log = log
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._every_s = redraw_s if self._tty else interval_s
        self._started = time.monotonic()
        self._next_s = self._started + self._every_s
        self._lock = threading.Lock()

    def describe(self) -> str:
        """``loading weights: 42% (1.3 GB of 3.1 GB), 12 s``; without a total, the time alone."""
        elapsed = time.monotonic() - self._started
        if not self.total:
            return f"{self.what}: {elapsed:.0f} s"
        share = min(self.done_bytes / self.total, 1.0)
        return f"{self.what}: {share:.0%} ({_size(self.done_bytes)} of {_size(self.total)}), {elapsed:.0f} s"

    def advance(self, amount: int = 0) -> None:
        """``amount`` more bytes done; shown when it is time to."""
        with self._lock:
            self.done_bytes += amount
            now = time.monotonic()
            if now < self._next_s:
                return
            self._next_s = now + self._every_s
            self._show()

    def _show(self) -> None:
        if not self._tty:
            self._log.info("%s", self.describe())
            return
        filled = _WIDTH * min(self.done_bytes, self.total) // self.total if self.total else 0
        bar = f"[{'#' * filled}{'.' * (_WIDTH - filled)}] " if self.total else ""
        self._stream.write(f"{_ERASE_LINE}{bar}{self.describe()}")
        self._stream.flush()

    @asynccontextmanager
    async def ticking(self) -> AsyncIterator[None]:
        """Inside the block, shown as time goes by even when nothing advances it."""

        async def tick() -> None:
            while True:
                await asyncio.sleep(self._every_s)
                self.advance()

        ticker = asyncio.ensure_future(tick())
        try:
            yield
        finally:
            ticker.cancel()

    def done(self) -> None:
        """The work ended: the bar is erased, and one log line says what it took."""
        with self._lock:
            if self._tty:
                self._stream.write(_ERASE_LINE)
                self._stream.flush()
            size = f"{_size(self.done_bytes)} " if self.done_bytes else ""
            self._log.info("%s: done, %sin %.1f s", self.what, size, time.monotonic() - self._started)
