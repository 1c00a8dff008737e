"""Rate-limited logging for events a flood can repeat thousands of times a second (refused
messages, failing handlers): the first few per interval are logged, the rest are summed into
one line."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, per_interval: int = 10, interval_s: float = 1.0) -> None:
        self._logger = logger
        self._per_interval = per_interval
        self._interval_s = interval_s
        self._window_start = 0.0
        self._logged = 0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        self._log(logging.WARNING, message, args, exc_info=False)

    def exception(self, message: str, *args: object, exc: BaseException | None = None) -> None:
        """An error with the traceback of ``exc``, by default the exception being handled."""
        self._log(logging.ERROR, message, args, exc_info=exc if exc is not None else True)

    def _log(self, level: int, message: str, args: tuple[object, ...], exc_info: bool | BaseException) -> None:
        now = time.monotonic()
        if now - self._window_start >= self._interval_s:
            if self._suppressed:
                self._logger.warning(
                    "... %d more like this in the last %.0f s", self._suppressed, now - self._window_start
                )
            self._window_start, self._logged, self._suppressed = now, 0, 0
        if self._logged < self._per_interval:
            self._logged += 1
            self._logger.log(level, message, *args, exc_info=exc_info)
        else:
            self._suppressed += 1
