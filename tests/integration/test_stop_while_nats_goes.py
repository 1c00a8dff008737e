"""Every process stops cleanly, exit 0 and no traceback, when it is told to stop while NATS is
going away: a coordinator, an engine and a gateway, each its own process as a user runs them,
and ``dpcoord up`` with its children.

Two ways NATS goes: it is killed while the processes say goodbye to it (it is stopped first with
SIGSTOP, so that every goodbye, a drain or an unsubscription, waits on it, and SIGKILLed once
each process logged that its way out began), or it is killed first and the processes are told
to stop while they reconnect. Each test runs its own nats-server, since it kills it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Iterator

import pytest

from service.bus.server import EmbeddedNatsServer, free_port
from tests.helpers import REPO_ROOT

DPCOORD = [sys.executable, "-m", "service"]
STOP_TIMEOUT_S = 30.0


class Process:
    """A ``dpcoord`` child whose standard error is read as it comes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._read = asyncio.ensure_future(self._read_all())
        self._logged = asyncio.Event()

    @classmethod
    async def start(cls, env: dict[str, str], *args: str) -> Process:
        process = await asyncio.create_subprocess_exec(
            *DPCOORD, *args, env=env, cwd=REPO_ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        return cls(process)

    async def _read_all(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            self.lines.append(raw.decode(errors="replace"))
            self._logged.set()

    async def logged(self, text: str, timeout_s: float = 30.0) -> None:
        async def seen() -> None:
            while not any(text in line for line in self.lines):
                if self._read.done():
                    raise AssertionError(f"exited before logging {text!r}: {''.join(self.lines)}")
                self._logged.clear()
                await self._logged.wait()

        await asyncio.wait_for(seen(), timeout_s)

    async def stopped(self) -> tuple[int, str]:
        """The exit code and the whole log, once the process ended."""
        code = await asyncio.wait_for(self.process.wait(), STOP_TIMEOUT_S)
        await self._read
        return code, "".join(self.lines)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


@pytest.fixture
def server() -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer() as running:
        yield running


@pytest.fixture
def env(server: EmbeddedNatsServer) -> dict[str, str]:
    return dict(
        {key: value for key, value in os.environ.items() if not key.startswith("DPCOORD_")},
        DPCOORD_NATS_URL=server.url,
        DPCOORD_SUBJECT_PREFIX="natsgoes",
        DPCOORD_BACKEND="echo",
        DPCOORD_HTTP_PORT="0",
        DPCOORD_GATEWAY_HOST="127.0.0.1",
        DPCOORD_GATEWAY_PORT=str(free_port()),
        DPCOORD_GATEWAY_DRAIN_S="1",
    )


def _signal_nats(server: EmbeddedNatsServer, signum: signal.Signals) -> None:
    assert server.pid is not None
    os.kill(server.pid, signum)


# What each role logs as its way out begins, before it says goodbye to NATS.
LEAVING = {
    "coordinator": "coordinator stopping on SIGTERM",
    "engine": "engine stopping on SIGTERM",
    "gateway": "Waiting for application shutdown",  # uvicorn's, before the app closes its connection
}


async def _nats_goes(
    server: EmbeddedNatsServer, signalled: list[Process], leaving: list[tuple[Process, str]], how: str
) -> None:
    """SIGTERM ``signalled`` while NATS goes away, ``how`` the module docstring says; ``leaving``
    is what each process logs once its way out began (every line, in a log, that proves it)."""
    if how == "while they say goodbye":
        _signal_nats(server, signal.SIGSTOP)
        for process in signalled:
            process.process.send_signal(signal.SIGTERM)
        for process, text in leaving:
            await process.logged(text)
        _signal_nats(server, signal.SIGKILL)
        return
    _signal_nats(server, signal.SIGKILL)
    for process in signalled:
        await process.logged("reconnecting")
        process.process.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("how", ["while they say goodbye", "before they stop"])
async def test_coordinator_engine_and_gateway_stop_cleanly_while_nats_goes_away(
    server: EmbeddedNatsServer, env: dict[str, str], how: str
) -> None:
    roles: dict[str, Process] = {}
    try:
        roles["coordinator"] = await Process.start(env, "coordinator")
        await roles["coordinator"].logged("serving")
        roles["engine"] = await Process.start(env, "engine")
        roles["gateway"] = await Process.start(env, "gateway")
        await roles["engine"].logged("registered with coordinator")
        await roles["gateway"].logged("gateway connected to coordinator")
        processes = list(roles.values())
        await _nats_goes(server, processes, [(roles[role], text) for role, text in LEAVING.items()], how)
        for role, process in roles.items():
            code, log = await process.stopped()
            assert (code, "Traceback" in log) == (0, False), f"{role}:\n{log}"
    finally:
        for process in roles.values():
            process.kill()


async def test_up_stops_cleanly_while_nats_goes_away(server: EmbeddedNatsServer, env: dict[str, str]) -> None:
    up = await Process.start(env, "up", "--engines", "1")
    try:
        await up.logged("gateway connected to coordinator")
        await up.logged("registered with coordinator")
        await _nats_goes(server, [up], [(up, text) for text in LEAVING.values()], "while they say goodbye")
        code, log = await up.stopped()
        assert code == 0, log
        assert "Traceback" not in log and "while stopping" not in log, log  # nor in its children's logs
    finally:
        up.kill()
