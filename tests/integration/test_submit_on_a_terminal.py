"""`dpcoord submit` on a terminal (a pseudo-terminal here) and in a pipe: escaped text and a
spinner on the terminal, the raw text and nothing else in the pipe."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys

from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.conftest import EngineFactory
from tests.helpers import REPO_ROOT
from tests.unit.cli.test_terminal import ESCAPED, HOSTILE


def submit_args(settings: Settings, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "service",
        "submit",
        *args,
        "--nats-url",
        settings.nats_url,
        "--subject-prefix",
        settings.subject_prefix,
    ]


def on_terminal(args: list[str]) -> tuple[int, str]:
    """Run with stdout and stderr on a pseudo-terminal; its exit code and everything it wrote."""
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, cwd=REPO_ROOT)
    finally:
        os.close(terminal)
    written = b""
    try:
        while chunk := _read(controller):
            written += chunk
    finally:
        os.close(controller)
    return process.wait(timeout=30), written.decode()


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every writer has closed the terminal
        return b""


def in_pipe(args: list[str]) -> tuple[int, str, str]:
    """Run with stdout and stderr on pipes: its exit code, stdout and stderr (carriage returns kept)."""
    done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, timeout=30, check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_streamed_text_is_escaped_on_a_terminal_and_raw_with_raw_or_in_a_pipe(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(1)
    tokens = str(len(HOSTILE.encode()))
    code, written = await asyncio.to_thread(
        on_terminal, submit_args(settings, HOSTILE, "--stream", "--max-tokens", tokens)
    )
    assert code == 0, written
    assert "\x1b" not in written and "\x07" not in written and "\u202e" not in written
    streamed, final = written.replace("\r\n", "\n").rstrip("\n").split("\n")
    assert streamed == ESCAPED
    assert json.loads(final)["generated_text"] == HOSTILE

    code, written = await asyncio.to_thread(
        on_terminal, submit_args(settings, HOSTILE, "--stream", "--max-tokens", tokens, "--raw")
    )
    assert code == 0 and HOSTILE.replace("\r", "") in written.replace("\r", "")

    code, stdout, _ = await asyncio.to_thread(
        in_pipe, submit_args(settings, HOSTILE, "--stream", "--max-tokens", tokens)
    )
    assert code == 0 and stdout.split("\n")[0] == HOSTILE


async def test_a_waiting_submission_shows_a_spinner_on_a_terminal_only(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(1, token_delay_ms=100)
    args = submit_args(settings, "Hello", "--max-tokens", "5")
    code, written = await asyncio.to_thread(on_terminal, args)
    assert code == 0, written
    spinner, _, final = written.rpartition("\r\x1b[K")
    assert "| waiting for the reply 0.0 s" in spinner and "/ waiting for the reply" in spinner  # the reply takes 0.5 s
    assert json.loads(final)["generated_text"] == "Hello"

    code, stdout, stderr = await asyncio.to_thread(in_pipe, args)
    assert code == 0 and stderr == ""
    assert json.loads(stdout)["generated_text"] == "Hello"
