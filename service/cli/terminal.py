"""What ``dpcoord submit`` writes to a terminal, and only to a terminal.

Generated text can hold any character (the random default model writes noise): written raw, an
ESC starts an escape sequence, a carriage return overwrites the line, a bidi override reorders
what follows. On a terminal those characters are written as ``\\uXXXX`` escapes, the JSON
spelling, so an escaped JSON line is still valid JSON; pipes and ``--raw`` get the text as it is.
A non-streamed submission shows a spinner while it waits, on a terminal only, and only while its
process is in the terminal's foreground process group: a submission held in the background
(``dpcoord submit ... &``) draws nothing over the next command's output. A control signal, which
may wait minutes (a drain), shows the spinner on a terminal and otherwise one line once the wait
lasts (:class:`Waiting`), so a log says why the command has not returned. What a wait learns on
the way (a submission held by a pause) changes the spinner's label, or is one line of its own
where no spinner is drawn (:meth:`Spinner.say`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable
from typing import Self, TextIO

_KEPT = frozenset("\n\t")
_FRAMES = "|/-\\"
_ERASE_LINE = "\r\x1b[K"


def escape_nonprintable(text: str) -> str:
    """``text`` with every character ``str.isprintable`` rejects, newline and tab apart, written
    as ``\\uXXXX`` (two UTF-16 escapes beyond U+FFFF)."""
    return "".join(char if char.isprintable() or char in _KEPT else _escape(char) for char in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def shown_on(stream: TextIO, raw: bool) -> Callable[[str], str]:
    """How text reaches ``stream``: escaped on a terminal unless ``raw``, as it is otherwise."""
    return escape_nonprintable if stream.isatty() and not raw else str


def in_foreground(stream: TextIO) -> bool:
    """Whether this process is in the foreground process group of the terminal ``stream`` is; a
    terminal that is not this process's controlling one has no job control, so there it is."""
    try:
        return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
    except ValueError:  # closed
        return False
    except OSError:  # not our controlling terminal (a pseudo-terminal handed to us, say)
        return True


class Spinner:
    """``| waiting 1.2 s`` redrawn on ``stream`` while the block runs, erased after it; nothing
    at all when ``stream`` is not a terminal, and nothing while the process is in the background."""

    def __init__(self, stream: TextIO, label: str, interval_s: float = 0.1) -> None:
        self._stream = stream
        self._label = label
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._drawn = False  # a frame is on the line, to erase

    async def __aenter__(self) -> Self:
        if self._stream.isatty():
            self._task = asyncio.create_task(self._spin())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self._drawn and in_foreground(self._stream):
            self._stream.write(_ERASE_LINE)
            self._stream.flush()

    def say(self, label: str) -> None:
        """``label`` from now on: the spinner's on a terminal, else one line of its own."""
        self._label = label
        if self._task is None:
            self._stream.write(f"{label}\n")
            self._stream.flush()

    async def _spin(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for frame in itertools.cycle(_FRAMES):
            if in_foreground(self._stream):
                self._stream.write(f"{_ERASE_LINE}{frame} {self._label} {loop.time() - started:.1f} s")
                self._stream.flush()
                self._drawn = True
            await asyncio.sleep(self._interval_s)


WAITING_LINE_AFTER_S = 1.0
"""How long a wait runs, off a terminal, before its label is written."""


class Waiting:
    """The spinner on a terminal; elsewhere (a pipe, a log file) ``label`` on a line of its own,
    written once the block has run ``line_after_s``, so that answers that come at once print
    nothing more."""

    def __init__(self, stream: TextIO, label: str, line_after_s: float = WAITING_LINE_AFTER_S) -> None:
        self._stream = stream
        self._label = label
        self._line_after_s = line_after_s
        self._spinner = Spinner(stream, label)
        self._line: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> Self:
        if self._stream.isatty():
            await self._spinner.__aenter__()
        else:
            self._line = asyncio.get_running_loop().call_later(self._line_after_s, self._write_line)
        return self

    def _write_line(self) -> None:
        self._stream.write(f"{self._label}\n")
        self._stream.flush()

    async def __aexit__(self, *exc_info: object) -> None:
        line, self._line = self._line, None
        if line is not None:
            line.cancel()
        await self._spinner.__aexit__(*exc_info)
