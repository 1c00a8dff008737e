"""How long ``dpcoord submit``, ``control`` and ``up`` wait, and what they say while and after
they do: a NATS that cannot be reached (a closed local port) is one line naming its URL, exit 1,
within the connect timeout; a drain pause is waited for as long as it may take, with a line
that says so; a signal not answered in time is one line with the coordinator's recorded state,
never a traceback."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator

import pytest

from service.bus.connection import NatsUnreachable
from service.cli.fleet_commands import CONTROL_WAIT_FLOOR_S, CONTROL_WAIT_MARGIN_S, control_wait_s
from service.cli.stack import until_ready
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.coordinator.observability import coordinator_observability
from service.ops.settings import Settings
from service.protocol.subjects import Header
from tests.conftest import EngineFactory
from tests.helpers import REPO_ROOT, new_shell_env, until

DPCOORD = [sys.executable, "-m", "service"]


def _closed_port() -> int:
    """A local port nothing listens on: connecting to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _start(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    """``dpcoord ARGS`` as a user runs it (its output a pipe, not a terminal), while this test's
    event loop keeps serving the in-process coordinator."""
    return await asyncio.create_subprocess_exec(
        *DPCOORD, *args, env=env, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )


async def _finish(process: asyncio.subprocess.Process, timeout_s: float = 60) -> tuple[int, str, str]:
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def _dpcoord(*args: str, env: dict[str, str], timeout_s: float = 60) -> tuple[int, str, str]:
    return await _finish(await _start(*args, env=env), timeout_s)


@pytest.fixture
async def observed(coordinator: Coordinator) -> AsyncIterator[Coordinator]:
    """The coordinator with its Services API status endpoint, as ``dpcoord coordinator`` runs it."""
    observability = coordinator_observability(coordinator, "127.0.0.1", None, False)
    await observability.start(coordinator.nc)
    yield coordinator
    await observability.stop()


def _cli_env(settings: Settings) -> dict[str, str]:
    return dict(os.environ, DPCOORD_NATS_URL=settings.nats_url, DPCOORD_SUBJECT_PREFIX=settings.subject_prefix)


@pytest.mark.parametrize(
    "command", [["submit", "Hello"], ["control", "pause", "--mode", "drain"], ["up", "--engines", "1"]]
)
async def test_an_unreachable_nats_is_one_line_naming_the_url_and_exit_1(command: list[str]) -> None:
    """A forgotten ``export DPCOORD_NATS_URL``: the command gives up within the connect timeout
    (1 s per server here) instead of retrying for ever, and names the URL without its password."""
    port = _closed_port()
    env = dict(new_shell_env(os.environ), DPCOORD_BACKEND="echo")
    url = f"nats://admin:s3cret@127.0.0.1:{port}"
    code, out, err = await _dpcoord(*command, "--nats-url", url, "--nats-connect-timeout-s", "1", env=env)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"cannot connect to NATS at nats://127.0.0.1:{port} within 1 s" in lines[0]
    assert "s3cret" not in err and "Traceback" not in err


async def test_a_drain_pause_is_waited_for_with_a_line_saying_so(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory
) -> None:
    """Without --timeout a drain gets the server's drain limit; the wait is said on a line of its
    own (stderr is a pipe here, so no spinner), and answered once the request in flight ended."""
    await start_engines(1, token_delay_ms=50)
    async with await DpcoordClient.connect(settings) as client:
        running = asyncio.ensure_future(client.submit("abc", max_tokens=1000, client_request_id="long"))
        await until(lambda: len(coordinator.requests) > 0, 10)
        pause = await _start("control", "pause", "--mode", "drain", env=_cli_env(settings))
        assert pause.stderr is not None
        wait_s = control_wait_s(Header.PAUSE, "drain", Settings())  # this environment's, as the command's
        line = await asyncio.wait_for(pause.stderr.readline(), 30)
        assert (
            line.decode()
            == f"dpcoord control pause --mode drain: waiting for the engines to confirm (up to {wait_s:.0f} s)\n"
        )
        assert not running.done()  # the drain waits for it
        await client.abort("long")  # ends it, and with it the drain
        code, out, err = await _finish(pause)
        assert code == 0, err
        assert '"state":"paused"' in out and '"mode":"drain"' in out
        assert (await asyncio.wait_for(running, 10)).finish_reason == "abort"
        await client.unpause()


async def test_a_signal_not_answered_in_time_is_one_line_with_the_recorded_state(
    settings: Settings, observed: Coordinator, start_engines: EngineFactory
) -> None:
    await start_engines(1, token_delay_ms=50)
    async with await DpcoordClient.connect(settings) as client:
        running = asyncio.ensure_future(client.submit("abc", max_tokens=1000, client_request_id="long"))
        await until(lambda: len(observed.requests) > 0, 10)
        code, out, err = await _dpcoord("control", "pause", "--mode", "drain", "--timeout", "1", env=_cli_env(settings))
        assert code == 1 and out == ""
        assert err.strip().splitlines() == [
            "dpcoord control: pause --mode drain: no answer within 1 s; the signal may still be taking effect "
            f"(the coordinator's record: state 'paused' at revision {observed.shared.revision}). "
            "Wait longer with --timeout SECONDS."
        ]
        await client.abort("long")
        await asyncio.wait_for(running, 10)


async def test_the_client_library_gives_up_on_an_unreachable_nats_within_the_connect_timeout() -> None:
    settings = Settings(nats_url=f"nats://127.0.0.1:{_closed_port()}", nats_connect_timeout_s=0.5)
    with pytest.raises(NatsUnreachable, match=r"cannot connect to NATS at nats://127\.0\.0\.1:\d+ within 0\.5 s"):
        await DpcoordClient.connect(settings, timeout=60)


def test_control_waits_as_long_as_the_coordinator_may_take() -> None:
    settings = Settings(control_timeout_s=5, long_control_timeout_s=600)
    assert control_wait_s(Header.PAUSE, "drain", settings) == 5 + 600 + CONTROL_WAIT_MARGIN_S
    assert control_wait_s(Header.UPDATE_WEIGHTS, None, settings) == 5 + 2 * 600 + CONTROL_WAIT_MARGIN_S
    assert control_wait_s(Header.PAUSE, "keep", settings) == CONTROL_WAIT_FLOOR_S
    assert control_wait_s(Header.STOP, None, Settings(control_timeout_s=30)) == 30 + 30 + CONTROL_WAIT_MARGIN_S


async def test_up_says_it_waits_for_engines_while_they_load(
    settings: Settings, observed: Coordinator, start_engines: EngineFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = asyncio.ensure_future(until_ready(settings, 1, line_every_s=0.2))
    await until(lambda: "waiting for the engines" in capsys.readouterr().err, 10)
    await start_engines(1)
    assert await asyncio.wait_for(ready, 10) == 1
