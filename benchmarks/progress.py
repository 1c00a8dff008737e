"""A progress bar on stderr for long benchmark runs: one line redrawn on a terminal, one line per step otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total = max(total, 1)
        self.done_steps = 0
        self._stream = stream
        self._width = width
        self._tty = stream.isatty()
        self._started = time.monotonic()

    def _bar(self) -> str:
        filled = self._width * self.done_steps // self.total
        elapsed = time.monotonic() - self._started
        eta = elapsed / self.done_steps * (self.total - self.done_steps) if self.done_steps else 0.0
        return f"[{'#' * filled}{'.' * (self._width - filled)}] {self.done_steps}/{self.total} eta {eta:4.0f} s"

    def step(self, label: str) -> None:
        """Announce the step about to run."""
        line = f"{self._bar()}  {label}"
        if self._tty:
            self._stream.write(f"\r\x1b[K{line}")
        else:
            self._stream.write(line + "\n")
        self._stream.flush()
        self.done_steps += 1

    def note(self, text: str) -> None:
        """A line that stays, such as a round's ratios."""
        self._stream.write(("\r\x1b[K" if self._tty else "") + text + "\n")
        self._stream.flush()

    def done(self) -> None:
        self.done_steps = self.total
        self.note(f"{self._bar()}  done")
