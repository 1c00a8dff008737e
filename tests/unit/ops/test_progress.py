"""Progress of long work: a bar on a terminal, a log line every interval elsewhere, one line
when it is done; and the checkpoint digest it follows, the same digest read in chunks."""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path

import pytest
import xxhash

from service.ops.progress import Progress
from service.protocol.checkpoint import DIGEST_PREFIX, checkpoint_digest

log = logging.getLogger("tests.progress")


class Terminal(io.StringIO):
    """Test double of a terminal: a stream that says it is a tty."""

    def isatty(self) -> bool:
        return True


def test_elsewhere_it_is_a_log_line_every_interval_then_one_when_done(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="tests.progress"):
        progress = Progress("loading weights from m", 3_000_000_000, log, stream, interval_s=0)
        progress.advance(1_500_000_000)
        quiet = Progress("quiet", 100, log, stream, interval_s=3600)
        quiet.advance(50)
        progress.done()
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0].startswith("loading weights from m: 50% (1.5 GB of 3.0 GB), ")
    assert lines[1].startswith("loading weights from m: done, 1.5 GB in ")
    assert len(lines) == 2 and stream.getvalue() == ""  # nothing drawn, nothing said by the quiet one


def test_on_a_terminal_it_is_a_bar_redrawn_and_erased(caplog: pytest.LogCaptureFixture) -> None:
    terminal = Terminal()
    with caplog.at_level(logging.INFO, logger="tests.progress"):
        progress = Progress("digest", 200, log, terminal, redraw_s=0)
        progress.advance(100)
        progress.done()
    assert terminal.getvalue() == f"\r\x1b[K[{'#' * 15}{'.' * 15}] digest: 50% (100 B of 200 B), 0 s\r\x1b[K"
    assert [record.getMessage() for record in caplog.records] == [caplog.records[0].getMessage()]
    assert caplog.records[0].getMessage().startswith("digest: done, 100 B in ")


async def test_work_that_cannot_count_shows_its_time_going_by(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tests.progress"):
        progress = Progress("swap", None, log, io.StringIO(), interval_s=0.01)
        async with progress.ticking():
            while not caplog.records:  # noqa: ASYNC110 (the ticker is what is tested)
                await asyncio.sleep(0.01)
    assert caplog.records[0].getMessage().startswith("swap: ") and caplog.records[0].getMessage().endswith(" s")


def test_the_digest_read_in_chunks_is_the_digest_of_the_whole_files(tmp_path: Path) -> None:
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    first.write_bytes(b"x" * 1000)
    second.write_bytes(b"")
    read: list[int] = []
    whole = xxhash.xxh3_128()
    for path, content in ((first, b"x" * 1000), (second, b"")):
        whole.update(path.name.encode())
        whole.update(len(content).to_bytes(8, "little"))
        whole.update(content)
    assert checkpoint_digest([first, second], read.append) == DIGEST_PREFIX + whole.hexdigest()
    assert read == [1000]
