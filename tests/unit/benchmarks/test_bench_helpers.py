"""The benchmark's own arithmetic (no processes): ratios per round, medians, the py-spy fold,
and reading another process's CPU time. The benchmark itself runs by `dpcoord bench`."""

from __future__ import annotations

import os
import time

from benchmarks.coordinator import TARGETS, build_parser, percentile, round_ratios, summarise
from benchmarks.proc_cpu import cpu_seconds
from benchmarks.py_spy_profile import fold


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
    rounds = [{"measured": m, "ratios": round_ratios(m)} for m in (_measured(40_000, 50_000), _measured(30_000, 60_000), _measured(45_000, 50_000))]
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
    assert (percentile(values, 50), percentile(values, 99), percentile([], 50) != percentile([], 50)) == (50.0, 99.0, True)


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
