"""``dpcoord up`` supervising its parts, run as a user runs it: a part that cannot start (the
gateway's port taken, the gateway extra missing) is named with why and the rest stopped, exit 1,
with no banner even when something else answers HTTP on that port; the gateway keeps port 8000
when only TIME_WAIT connections of an earlier run hold it; Ctrl-C during start stops everything
within seconds; SIGKILL of ``up`` takes its children with it; health and metrics listen on the
loopback only."""

from __future__ import annotations

import http.server
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.cli import stack
from service.ops.settings import Settings
from tests.helpers import REPO_ROOT, new_shell_env, read_up_banner

DPCOORD = [sys.executable, "-m", "service"]
NATS_READY = re.compile(r"nats-server ready at nats://127\.0\.0\.1:(\d+)")


def _env(prefix: str) -> dict[str, str]:
    return dict(new_shell_env(os.environ), DPCOORD_BACKEND="echo", DPCOORD_SUBJECT_PREFIX=prefix)


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_children(int(child))]
    return found


def _gone(pids: list[int], timeout_s: float) -> list[int]:
    """Those of ``pids`` still alive (zombies count as gone) after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return "zombie"


class _AlwaysReady(http.server.BaseHTTPRequestHandler):
    """Another HTTP server, which answers 200 to everything, /readyz included."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok: not dpcoord\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def other_http_server() -> Iterator[int]:
    """The port of another HTTP server on this host, answering 200 to every path."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AlwaysReady)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_gateway_port_in_use_is_named_with_the_fix_and_everything_stops(other_http_server: int) -> None:
    """The port is another server's, which answers /readyz with 200 itself: no banner all the
    same, since the gateway never said it listens."""
    port = other_http_server
    started = time.monotonic()
    result = subprocess.run(
        [*DPCOORD, "up", "--engines", "1", "--gateway-port", str(port)],
        env=_env("upbusy"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "dpcoord up: the gateway exited with code 1; its last log lines:" in result.stderr
    assert "cannot listen on 127.0.0.1" in result.stderr and "--gateway-port PORT" in result.stderr
    assert time.monotonic() - started < 30
    nats = NATS_READY.search(result.stderr)
    assert nats is not None and not _listening(int(nats.group(1)))  # the embedded nats-server is gone too


def _time_wait_on(port: int) -> bool:
    return any(
        int(line.split()[1].rpartition(":")[2], 16) == port and line.split()[3] == "06"  # TIME_WAIT
        for table in ("/proc/net/tcp", "/proc/net/tcp6")
        for line in Path(table).read_text().splitlines()[1:]
    )


def test_connections_in_time_wait_do_not_make_the_gateway_port_look_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a restart, the last run's connections to port 8000 linger in TIME_WAIT; the gateway
    (SO_REUSEADDR, as uvicorn and asyncio bind) can listen there, so ``up`` keeps the port."""
    with socket.socket() as listening:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listening.accept()
            accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    deadline = time.monotonic() + 5
    while not _time_wait_on(port):  # the last ACK crosses the loopback
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # a bind without SO_REUSEADDR, as up's check did, fails here
    monkeypatch.setattr(stack, "GATEWAY_PORT", port)
    assert stack.gateway_port(Settings(), "127.0.0.1") == port


def test_a_missing_gateway_extra_is_named_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(stack, "GATEWAY_MODULES", ("dpcoord_test_no_such_module",))
    assert stack.missing_gateway_modules() == ["dpcoord_test_no_such_module"]
    assert stack.asyncio.run(stack.run_stack(Settings(), 1, None)) == 1
    err = capsys.readouterr().err
    assert "pip install 'dpcoord[gateway]'" in err and "--no-gateway" in err


def test_ctrl_c_during_start_stops_everything_within_seconds(tmp_path: Path) -> None:
    """SIGINT while the engines are still starting: everything is gone within a few seconds."""
    log = (tmp_path / "up.log").open("w+")
    up = subprocess.Popen([*DPCOORD, "up", "--engines", "2"], env=_env("upint"), cwd=REPO_ROOT, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while "nats-server ready" not in Path(log.name).read_text():
            assert time.monotonic() < deadline and up.poll() is None
            time.sleep(0.05)
        children = _children(up.pid)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=15) == 0
        assert _gone(children, 5) == []
    finally:
        if up.poll() is None:
            up.kill()
        log.close()


def test_children_die_with_a_killed_up_and_health_listens_on_the_loopback(tmp_path: Path) -> None:
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [*DPCOORD, "up", "--engines", "1"],
        env=_env("upkill"),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        assert up.stdout is not None
        lines = read_up_banner(up.stdout)
        health = next(line.split()[3] for line in lines if line.startswith("Health and metrics:"))
        health_port = int(health.split(":")[2].split("/")[0])
        assert _listening(health_port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0
        api = next(line.split()[2] for line in lines if line.startswith("OpenAI API:"))
        with urllib.request.urlopen(api.removesuffix("/v1") + "/health", timeout=5) as ready:
            assert ready.status == 200
        children = _children(up.pid)
        assert len(children) >= 4  # nats-server, coordinator, engine, gateway
        up.kill()
        up.wait()
        assert _gone(children, 10) == []
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
