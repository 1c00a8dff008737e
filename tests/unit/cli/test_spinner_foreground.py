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
    import asyncio, sys
    from service.cli.terminal import Spinner
    async def main():
        async with Spinner(sys.stderr, "waiting", interval_s=0.01):
            await asyncio.sleep(0.2)
    asyncio.run(main())
    sys.stderr.write("END\\n")
    """
)
# The session leader on the pseudo-terminal runs the spinner in its own (foreground) process
# group, or in a new one, which is then a background job of that terminal.
LAUNCH = textwrap.dedent(
    """
    import subprocess, sys
    background = sys.argv[2] == "background"
    subprocess.run([sys.executable, "-c", sys.argv[1]], process_group=0 if background else None, check=True)
    """
)


def _drawn(where: str) -> str:
    """What the spinner wrote to its terminal, run under a new session on a pseudo-terminal."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, and it leads the foreground group
        os.execv(sys.executable, [sys.executable, "-c", LAUNCH, SPIN, where])
    out = b""
    try:
        while chunk := os.read(fd, 4096):
            out += chunk
    except OSError:  # EIO: every writer has closed the terminal
        pass
    os.waitpid(pid, 0)
    os.close(fd)
    return out.decode(errors="replace")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal job control as on Linux")
def test_the_spinner_draws_only_in_the_foreground() -> None:
    foreground, background = _drawn("foreground"), _drawn("background")
    assert "END" in foreground and "waiting" in foreground
    assert "END" in background and "waiting" not in background
