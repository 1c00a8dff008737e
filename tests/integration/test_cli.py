"""The `dpcoord` command line as a user runs it: separate processes over a real nats-server."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from service.cli import main as cli_main
from service.cli.main import build_parser, main, settings_from
from service.ops.setting_groups import SettingGroup, group_of
from service.ops.settings import Settings
from tests.helpers import REPO_ROOT, new_shell_env, read_up_banner

DPCOORD = [sys.executable, "-m", "service"]


def run(args: list[str], env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(DPCOORD + args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')} "


COMMAND_GROUPS = {
    "submit": {SettingGroup.NATS},
    "control": {SettingGroup.NATS},
    "coordinator": {SettingGroup.NATS, SettingGroup.SERVICE, SettingGroup.COORDINATOR},
    "engine": {SettingGroup.NATS, SettingGroup.SERVICE, SettingGroup.ENGINE, SettingGroup.TORCH},
    "up": set(SettingGroup),
}


@pytest.mark.parametrize("command", sorted(COMMAND_GROUPS))
def test_help_lists_the_settings_the_command_uses(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    help_text = help_of(command, capsys)
    for name, field in Settings.model_fields.items():
        assert (flag(name) in help_text) == (group_of(field) in COMMAND_GROUPS[command]), name
    for group in SettingGroup:
        assert (f"settings: {group}:" in help_text) == (group in COMMAND_GROUPS[command])
    assert help_text.count("DPCOORD_<NAME>") == 1


def test_flags_win_over_env_and_every_command_reads_every_setting_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPCOORD_SUBJECT_PREFIX", "from-env")
    monkeypatch.setenv("DPCOORD_REQUEST_TIMEOUT_S", "12")
    monkeypatch.setenv("DPCOORD_MAX_BATCH", "3")
    args = build_parser().parse_args(["coordinator", "--subject-prefix", "from-flag", "--max-retries", "5"])
    settings = settings_from(args)
    assert (settings.subject_prefix, settings.max_retries, settings.request_timeout_s) == ("from-flag", 5, 12.0)
    assert settings_from(build_parser().parse_args(["submit", "Hello"])).max_batch == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["submit", "Hello", "--max-batch", "3"])


def test_up_help_says_what_engines_run_how_to_use_an_existing_nats_and_where_logs_go(
    capsys: pytest.CaptureFixture[str],
) -> None:
    help_text = help_of("up", capsys)
    assert "the torch backend runs the model in --model" in help_text and "output is noise" in help_text
    assert "--backend echo" in help_text
    assert "unless --nats-url (DPCOORD_NATS_URL) points at an\nexisting server" in help_text
    assert "every process logs to this command's stderr" in help_text


def test_invalid_settings_are_reported_and_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ, DPCOORD_HEARTBEAT_INTERVAL_S="5", DPCOORD_HEARTBEAT_TIMEOUT_S="1")
    result = run(["coordinator"], env)
    assert result.returncode == 2 and "heartbeat_interval_s" in result.stderr


def test_up_submit_control_and_stop(tmp_path: Path) -> None:
    env = new_shell_env(os.environ)  # `make up` without the virtual environment activated
    env["DPCOORD_BACKEND"] = "echo"
    env["DPCOORD_SUBJECT_PREFIX"] = "clitest"
    log = (tmp_path / "up.log").open("w")
    stack = subprocess.Popen(
        DPCOORD + ["up", "--engines", "2"], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True
    )
    try:
        assert stack.stdout is not None
        lines = read_up_banner(stack.stdout)
        assert lines[0] == "dpcoord is up: coordinator + 2 echo engine(s)\n"
        metrics = next(line.split()[3] for line in lines if line.startswith("Health and metrics:"))
        with urllib.request.urlopen(metrics.replace("/metrics", "/readyz"), timeout=5) as ready:
            assert ready.read() == b"ok: 2 engine(s), state running\n"  # the banner waits for every engine
        url = next(line.split()[1] for line in lines if line.startswith("NATS:"))
        assert url.startswith("nats://127.0.0.1:")
        client_env = dict(env, DPCOORD_NATS_URL=url)

        # In a second terminal: no DPCOORD_ variables, the virtual environment not activated.
        printed = next(line.removeprefix("Submit: ") for line in lines if line.startswith("Submit: "))
        assert not printed.startswith("dpcoord ")
        as_printed = subprocess.run(
            printed,
            shell=True,
            env=new_shell_env(env),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert as_printed.returncode == 0, as_printed.stderr
        assert json.loads(as_printed.stdout.splitlines()[-1])["generated_text"].startswith("Hello")

        streamed = run(["submit", "Hello", "--stream", "--max-tokens", "5"], client_env)
        assert streamed.returncode == 0, streamed.stderr
        text, final_line = streamed.stdout.splitlines()
        assert text == "Hello" and json.loads(final_line)["generated_text"] == "Hello"

        plain = run(["submit", "ab", "--max-tokens", "3"], client_env)
        assert json.loads(plain.stdout)["generated_text"] == "aba"

        # The banner's curl line, as a user pastes it.
        curl = shlex.split(next(line for line in lines if line.strip().startswith("curl ")))
        request = urllib.request.Request(
            curl[1], data=curl[curl.index("-d") + 1].encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            completion = json.loads(response.read())
        assert completion["model"] == "dpcoord-echo" and completion["choices"][0]["text"] == "HelloHelloHelloH"

        assert json.loads(run(["control", "pause"], client_env).stdout)["state"] == "paused"
        suspended = run(["control", "suspend"], client_env)
        assert json.loads(suspended.stdout)["state"] == "suspended"
        weights = tmp_path / "weights"
        weights.mkdir()
        (weights / "model.safetensors").write_bytes(b"echo engines digest the bytes")
        updated = json.loads(run(["control", "update-weights", str(weights), "--version", "7"], client_env).stdout)
        assert updated["weight_version"] == 7 and updated["digest"].startswith("xxh3-128:")
        assert len(updated["engines"]) == 2
        again = run(["control", "unpause"], client_env)
        assert again.returncode == 1 and "409" in again.stderr
        assert json.loads(run(["control", "epoch", "9"], client_env).stdout)["epoch"] == 9

        # The engines leave once they confirmed a stop; up says so and ends, exit 0 (make: no Error 1).
        assert json.loads(run(["control", "stop"], client_env).stdout)["state"] == "stopping"
        assert stack.wait(timeout=30) == 0
        up_log = Path(log.name).read_text()
        assert "stopped, as it was asked to (dpcoord control stop or shutdown, or a SIGTERM)" in up_log
        assert "Traceback" not in up_log and "while stopping" not in up_log
    finally:
        if stack.poll() is None:
            stack.send_signal(signal.SIGINT)
            stack.wait(timeout=30)
        log.close()


def test_up_exits_1_without_a_banner_when_every_engine_fails_to_start(tmp_path: Path) -> None:
    env = dict(new_shell_env(os.environ), DPCOORD_SUBJECT_PREFIX="clifail")
    result = run(["up", "--engines", "1", "--backend", "echo", "--model", str(tmp_path)], env)
    assert result.returncode == 1 and result.stdout == ""
    assert "--model needs the torch backend" in result.stderr
    assert "dpcoord up: the engine 0 exited with code" in result.stderr


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


def test_bench_passes_its_own_options_through_and_its_help_names_the_other_benchmarks() -> None:
    result = run(["bench", "--help"], dict(os.environ))
    assert result.returncode == 0 and "--quick" in result.stdout and "dpcoord bench" in result.stdout
    for other in ("--gateway", "--simulated-engines N,N,...", "--instructions"):
        assert f"\n  {other}" in result.stdout, other  # an option of its own, with its help


def test_bench_says_clearly_when_the_benchmarks_are_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli_main, "BENCHMARK_MODULE", "benchmarks.not_installed_here")
    assert cli_main.main(["bench", "--quick"]) == 2
    assert "benchmarks.not_installed_here is not installed here" in capsys.readouterr().err
