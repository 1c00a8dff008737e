"""The spinner draws on a terminal only while its process is in the terminal's foreground process
group: run in a pseudo-terminal it controls (foreground), then moved to a process group of its
own (background, as ``dpcoord submit ... &`` is)."""

from __future__ import annotations

import os
import pty
import sys
import textwrap

import pytest

SPIN = textwrap.dedent(
    """
    import asyncio, os, sys
    from service.cli.terminal import Spinner
    if sys.argv[1] == "background":
        os.setpgid(0, 0)  # a process group that is not the terminal's foreground one
    async def main():
        async with Spinner(sys.stderr, "waiting", interval_s=0.01):
            await asyncio.sleep(0.2)
    asyncio.run(main())
    sys.stderr.write("END\\n")
    """
)


def _drawn(where: str) -> str:
    """What the spinner wrote to its terminal, run in a new session on a pseudo-terminal."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, and it leads the foreground group
        os.execv(sys.executable, [sys.executable, "-c", SPIN, where])
    out = b""
    try:
        while b"END" not in out:
            out += os.read(fd, 4096)
    except OSError:  # the child closed the terminal
        pass
    os.waitpid(pid, 0)
    os.close(fd)
    return out.decode(errors="replace")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal job control as on Linux")
def test_the_spinner_draws_only_in_the_foreground() -> None:
    assert "waiting" in _drawn("foreground")
    assert "waiting" not in _drawn("background")
