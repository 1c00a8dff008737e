"""What a command that may wait long (a drain pause) shows where its stderr is no terminal: one
line once the wait lasts, and nothing when the answer comes at once."""

from __future__ import annotations

import asyncio
import io

from service.cli.terminal import Spinner, Waiting


class _Log(io.StringIO):
    """A stream that is not a terminal, and says when it was written to."""

    def __init__(self) -> None:
        super().__init__()
        self.written = asyncio.Event()

    def write(self, text: str) -> int:
        self.written.set()
        return super().write(text)


async def test_a_quick_answer_prints_nothing() -> None:
    stream = _Log()
    async with Waiting(stream, "waiting for every engine", line_after_s=60):
        pass
    assert stream.getvalue() == ""


async def test_a_wait_that_lasts_is_said_once_on_a_line_of_its_own() -> None:
    stream = _Log()
    async with Waiting(stream, "waiting for every engine", line_after_s=0):
        await asyncio.wait_for(stream.written.wait(), 5)
    assert stream.getvalue() == "waiting for every engine\n"


async def test_what_a_wait_learns_is_one_line_where_no_spinner_is_drawn() -> None:
    stream = _Log()
    async with Spinner(stream, "waiting for the reply") as spinner:
        spinner.say("held: the fleet is paused")
    assert stream.getvalue() == "held: the fleet is paused\n"
