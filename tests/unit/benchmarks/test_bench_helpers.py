"""The benchmark's own arithmetic (no processes): ratios per round, medians, the py-spy fold,
reading another process's CPU time, and extracting another revision to measure beside this one.
The benchmark itself runs by `dpcoord bench`."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import cast

import msgspec
import pytest

from benchmarks.common import extract, percentile
from benchmarks.coordinator import build_parser
from benchmarks.coordinator_figures import TARGETS, round_ratios, summarise
from benchmarks.fleet import build_parser as fleet_parser
from benchmarks.fleet_bench import RunningFleet
from benchmarks.fleet_summary import FleetResult
from benchmarks.fleet_summary import summarise as summarise_fleets
from benchmarks.fleet_targets import judge
from benchmarks.fleet_workload import Workload
from benchmarks.gateway_ab import build_parser as gateway_ab_parser
from benchmarks.instructions import KINDS, bodies, read_summary
from benchmarks.instructions import build_parser as instructions_parser
from benchmarks.proc_cpu import busy_cpu_seconds, cpu_seconds
from benchmarks.py_spy_profile import fold
from service.cli.main import main as cli_main
from service.protocol.messages import SubmitEnvelope
from service.protocol.subjects import Subjects


def _measured(dpcoord_rate: float, raw_rate: float) -> dict:
    def window(rate: float, cpu: dict[str, float]) -> dict:
        return {"per_s": rate, "completed": int(rate), "seconds": 1.0, "errors": 0, "cpu_us_per": cpu}

    return {
        "pipelined": {
            "dpcoord": window(dpcoord_rate, {"coordinator": 9.0}),
            "raw_2hop": window(raw_rate, {"coordinator": 0.0}),
            "dpcoord_long_prompt": window(dpcoord_rate / 2, {"coordinator": 20.0}),
        },
        "sequential": {
            "dpcoord": {"p50_us": 500.0, "p99_us": 900.0, "per_s": 2000.0, "errors": 0, "cpu_us_per": {}},
            "raw_4hop": {"p50_us": 400.0, "p99_us": 800.0, "per_s": 2500.0, "errors": 0, "cpu_us_per": {}},
        },
    }


def test_round_ratios_divide_within_the_round_and_report_cpu_as_is() -> None:
    ratios = round_ratios(_measured(40_000, 50_000))
    assert ratios["pipelined_vs_raw_2hop"] == 0.8
    assert ratios["long_prompt_vs_short"] == 0.5
    assert ratios["sequential_p50_vs_raw_4hop"] == 1.25
    assert ratios["coordinator_cpu_us_per_request"] == 9.0
    assert "streaming_vs_raw_relay" not in ratios  # not measured in that round


def test_summary_takes_medians_of_per_round_ratios_and_judges_targets() -> None:
    rounds = [
        {"measured": m, "ratios": round_ratios(m)}
        for m in (_measured(40_000, 50_000), _measured(30_000, 60_000), _measured(45_000, 50_000))
    ]
    summary = summarise(rounds)
    assert summary["ratios"]["pipelined_vs_raw_2hop"] == 0.8
    assert summary["ratio_range"]["pipelined_vs_raw_2hop"] == [0.5, 0.9]
    assert summary["targets"]["pipelined_vs_raw_2hop"]["met"] is True
    assert summary["targets"]["sequential_p50_vs_raw_4hop"]["met"] is False
    assert summary["targets"]["coordinator_cpu_us_per_request"]["met"] is True
    assert summary["medians"]["pipelined"]["dpcoord"]["per_s"] == 40_000
    assert set(summary["targets"]) <= set(TARGETS)


def test_percentile_of_sorted_values() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile([], 50) != percentile([], 50)) == (
        50.0,
        99.0,
        True,
    )


def test_fold_counts_self_and_inclusive_time_per_function() -> None:
    collapsed = (
        "main (service/cli.py:10);run (service/coordinator.py:100);admit (service/coordinator.py:200) 3\n"
        "main (service/cli.py:10);run (service/coordinator.py:101) 1\n"
        "garbage line\n"
    )
    profile = fold(collapsed)
    assert profile.samples == 4
    assert profile.self_time["admit (service/coordinator.py)"] == 3
    assert profile.inclusive["run (service/coordinator.py)"] == 4
    assert profile.table(1) == [("admit (service/coordinator.py)", 75.0, 75.0)]


def test_cpu_seconds_reads_a_process_own_accounting() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) >= before + 0.03


def test_bench_command_line_parses_the_documented_flags() -> None:
    args = build_parser().parse_args(["--rounds", "3", "--only", "pipelined", "--engines", "2"])
    assert (args.rounds, args.only, args.engines, args.inflight) == (3, ["pipelined"], 2, 256)


# ---------------------------------------------------------------- the fleet-size benchmark


def _fleet(
    engines: int,
    cpu_ratio: float,
    rate_ratio: float,
    per_message: float,
    registration_cpu: float = 0.01,
    idle: float = 1.0,
) -> FleetResult:
    return FleetResult(
        policy="least_loaded",
        engines=engines,
        registration_s=0.1,
        registration_cpu_s=registration_cpu,
        idle_core_pct=idle,
        offered_per_s=1000.0,
        achieved_per_s=1000.0 * rate_ratio,
        p50_ms=1.0,
        p99_ms=2.0,
        cpu_us_per_request=20.0 * cpu_ratio,
        coordinator_core_pct=50.0,
        requests_per_routed_message=per_message,
        kv_events_per_request=0.0,
        others_cores=0.5,
        sent=1000,
        lost=0,
        duplicated=0,
        errors=0,
        engines_lost=0,
        log_lines=6,
        cpu_ratio=cpu_ratio,
        rate_ratio=rate_ratio,
    )


def test_fleet_targets_are_ratios_to_the_smallest_fleet_and_misses_say_why() -> None:
    results = [_fleet(2, 1.0, 1.0, 10.0), _fleet(1000, 1.3, 0.99, 2.0), _fleet(3000, 1.45, 0.9, 2.0, 0.2, 6.0)]
    verdicts = judge(results)
    assert [(round(v["value"], 3), v["met"]) for v in verdicts] == [
        (1.3, False),
        (1.45, True),
        (0.99, True),
        (0.2, False),
        (6.0, False),
    ]
    assert "requests per routed message 10.0 -> 2.0" in verdicts[0]["why"]
    assert verdicts[0]["name"] == "coordinator CPU per request vs 2 engines (1000 / 2 engines)"


def test_fleet_summary_takes_medians_and_per_round_ratios(tmp_path: Path) -> None:
    def window(cpu: float, rate: float) -> dict[str, float]:
        return {
            "achieved_per_s": rate,
            "p50_ms": 1.0,
            "p99_ms": 2.0,
            "cpu_us_per_request": cpu,
            "coordinator_core_pct": 50.0,
            "requests_per_routed_message": 4.0,
            "kv_events_per_request": 0.5,
            "others_cores": 0.1,
            "sent": 10,
            "lost": 0,
            "duplicated": 0,
            "errors": 0,
            "engines_lost": 0,
        }

    log = tmp_path / "coordinator.log"
    log.write_text("one\ntwo\n")
    no_process = cast(asyncio.subprocess.Process, None)  # summarise_fleets reads no process
    small = RunningFleet(
        "p2c",
        2,
        Subjects("x"),
        no_process,
        no_process,
        log,
        windows=[window(10, 100), window(20, 100), window(30, 100)],
    )
    large = RunningFleet(
        "p2c", 9, Subjects("y"), no_process, no_process, log, windows=[window(11, 90), window(40, 100), window(30, 95)]
    )
    _, result = summarise_fleets([small, large], 100.0)
    assert (result.cpu_us_per_request, result.achieved_per_s, result.sent, result.log_lines) == (30, 95, 30, 2)
    assert result.cpu_ratio == pytest.approx(1.1)  # median of 1.1, 2.0 and 1.0
    assert result.rate_ratio == pytest.approx(0.95)


def test_fleet_workload_is_envelopes_with_unique_ids_and_prefix_hashes() -> None:
    workload = Workload()
    first, second = (msgspec.msgpack.decode(workload(number), type=SubmitEnvelope) for number in (0, 1))
    assert (first.client_request_id, second.client_request_id) == (0, 1)
    assert first.client_id == second.client_id
    assert len(first.prefix_hashes or []) == 8  # blocks 1, 2, 4, ..., 64 and 66 of a 1,056-token prompt
    assert first.prefix_hashes[:7] == msgspec.msgpack.decode(workload(8), type=SubmitEnvelope).prefix_hashes[:7]  # type: ignore[index]


def test_fleet_command_line_and_the_dpcoord_bench_switch(capsys: pytest.CaptureFixture[str]) -> None:
    args = fleet_parser().parse_args(["--simulated-engines", "2,100", "--policies", "least_loaded,prefix"])
    assert (args.simulated_engines, args.policies) == ([2, 100], ["least_loaded", "prefix"])
    with pytest.raises(SystemExit):
        cli_main(["bench", "--simulated-engines", "2", "--help"])
    assert "Fleet-size benchmark" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["bench", "--quick", "--help"])
    assert "Coordinator benchmark" in capsys.readouterr().out


def test_busy_cpu_seconds_grows() -> None:
    before = busy_cpu_seconds()
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert busy_cpu_seconds() > before


# ---------------------------------------------------------------- the instruction count


def test_instruction_count_reads_the_dump_summary_and_its_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    dump = "# callgrind format\nversion: 1\ndesc: Trigger: dump measured\nevents: Ir\nsummary: 566628566\n\nfn=x\n"
    assert read_summary(dump) == 566_628_566
    with pytest.raises(ValueError, match="summary"):
        read_summary("events: Ir\n")
    args = instructions_parser().parse_args(["--baseline", "main", "--kinds", "plain,long"])
    assert (args.baseline, args.kinds, args.requests, args.process) == ("main", ["plain", "long"], 8192, "coordinator")
    assert instructions_parser().parse_args(["--process", "engine"]).process == "engine"
    for wrong in (["--kinds", "plain,huge"], ["--requests", "100"]):
        with pytest.raises(SystemExit):
            instructions_parser().parse_args(wrong)
    with pytest.raises(SystemExit):
        cli_main(["bench", "--instructions", "--help"])
    assert "instructions per request" in capsys.readouterr().out


def test_instruction_count_workloads_are_named_where_the_client_library_would_be() -> None:
    plain, envelope, long = (bodies(kind, 2) for kind in KINDS)
    assert plain[0] == plain[1]
    first, second = (msgspec.msgpack.decode(body, type=SubmitEnvelope) for body in envelope)
    assert (first.client_id, first.client_request_id, second.client_request_id) == ("bench", 0, 1)
    assert len(long[0]) > 20_000 > len(envelope[0])


def test_extract_gives_another_revisions_services(tmp_path: Path) -> None:
    tree = extract("HEAD", tmp_path / "baseline")
    assert (tree / "service" / "gateway" / "server.py").is_file()
    assert (tree / "engines").is_dir() and (tree / "handlers").is_dir()
    assert not (tree / "benchmarks").exists()  # the benchmark itself runs from this checkout


def test_gateway_ab_needs_a_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gateway_ab_parser().parse_args([])
    assert "--baseline" in capsys.readouterr().err
    args = gateway_ab_parser().parse_args(["--baseline", "main", "--rounds", "3"])
    assert (args.baseline, args.rounds, args.duration, args.connections) == ("main", 3, 2.0, 64)
