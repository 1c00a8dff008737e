"""The `dpcoord` command line as a user runs it: separate processes over a real nats-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main as cli_main
from service.cli.main import build_parser, settings_from
from service.ops.settings import Settings
from tests.helpers import REPO_ROOT, read_up_banner

DPCOORD = [sys.executable, "-m", "service"]


def run(args: list[str], env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(DPCOORD + args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def test_every_setting_is_a_flag_and_flags_win_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPCOORD_SUBJECT_PREFIX", "from-env")
    monkeypatch.setenv("DPCOORD_REQUEST_TIMEOUT_S", "12")
    args = build_parser().parse_args(["coordinator", "--subject-prefix", "from-flag", "--max-retries", "5"])
    settings = settings_from(args)
    assert (settings.subject_prefix, settings.max_retries, settings.request_timeout_s) == ("from-flag", 5, 12.0)
    help_text = build_parser()._subparsers._group_actions[0].choices["coordinator"].format_help()  # type: ignore[union-attr]
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in help_text


def test_invalid_settings_are_reported_and_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ, DPCOORD_HEARTBEAT_INTERVAL_S="5", DPCOORD_HEARTBEAT_TIMEOUT_S="1")
    result = run(["coordinator"], env)
    assert result.returncode == 2 and "heartbeat_interval_s" in result.stderr


def test_up_submit_control_and_ctrl_c(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("DPCOORD_NATS_URL", None)
    env["DPCOORD_BACKEND"] = "echo"
    env["DPCOORD_SUBJECT_PREFIX"] = "clitest"
    log = (tmp_path / "up.log").open("w")
    stack = subprocess.Popen(DPCOORD + ["up", "--engines", "2"], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert stack.stdout is not None
        lines = read_up_banner(stack.stdout)
        url = next(line.split()[1] for line in lines if line.startswith("NATS:"))
        assert url.startswith("nats://127.0.0.1:")
        client_env = dict(env, DPCOORD_NATS_URL=url)

        streamed = run(["submit", "Hello", "--stream", "--max-tokens", "5"], client_env)
        assert streamed.returncode == 0, streamed.stderr
        text, final_line = streamed.stdout.splitlines()
        assert text == "Hello" and json.loads(final_line)["generated_text"] == "Hello"

        plain = run(["submit", "ab", "--max-tokens", "3"], client_env)
        assert json.loads(plain.stdout)["generated_text"] == "aba"

        assert json.loads(run(["control", "pause"], client_env).stdout)["state"] == "paused"
        suspended = run(["control", "suspend"], client_env)
        assert json.loads(suspended.stdout)["state"] == "suspended"
        again = run(["control", "unpause"], client_env)
        assert again.returncode == 1 and "409" in again.stderr
        assert json.loads(run(["control", "epoch", "9"], client_env).stdout)["epoch"] == 9
    finally:
        stack.send_signal(signal.SIGINT)
        assert stack.wait(timeout=30) == 0
        log.close()


def test_coordinator_exits_0_on_shutdown(nats_url: str) -> None:
    env = dict(os.environ, DPCOORD_NATS_URL=nats_url, DPCOORD_SUBJECT_PREFIX="shutdowntest")
    coordinator = subprocess.Popen(DPCOORD + ["coordinator"], env=env, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert coordinator.stderr is not None
        for line in coordinator.stderr:
            if "serving" in line:
                break
        result = run(["control", "shutdown"], env)
        assert json.loads(result.stdout)["signal"] == "shutdown"
        assert coordinator.wait(timeout=15) == 0
    finally:
        if coordinator.poll() is None:
            coordinator.kill()


def test_bench_passes_its_own_options_through() -> None:
    result = run(["bench", "--help"], dict(os.environ))
    assert result.returncode == 0 and "--quick" in result.stdout and "dpcoord bench" in result.stdout


def test_bench_says_clearly_when_the_benchmarks_are_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli_main, "BENCHMARK_MODULE", "benchmarks.not_installed_here")
    assert cli_main.main(["bench", "--quick"]) == 2
    assert "benchmarks.not_installed_here is not installed here" in capsys.readouterr().err
