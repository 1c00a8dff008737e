"""The figures of the cache-aware routing benchmark, per workload and routing policy, and its
targets (issue 33), judged on ratios measured in the same run.

- **hit ratio**: the engines' ``dpcoord_engine_prefix_cache_hit_tokens`` over ``queried_tokens``
  over the workload (deltas of every engine's counters), and its share of the workload's ideal;
- **TTFT** p50 and p99: submission to the first token, at the client;
- **requests/s**: requests over the time from the first submission to the last final;
- **engine CPU per request**: the engine processes' CPU seconds over the workload, per request
  (steadier than requests/s on a shared machine: what the routing costs the engines' work);
- **load max/mean**: the largest engine load over the mean, sampled through the run, as the
  integral of the largest engine's requests in flight over the integral of the mean (sampled
  every 10 ms from the requests' own submit and final times and engines): a moment with many
  requests weighs more than the last few stragglers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks.cache_workloads import Outcome, WorkloadRun
from benchmarks.common import percentile

SAMPLE_S = 0.01


@dataclass(slots=True)
class Figures:
    workload: str
    policy: str
    requests: int
    hit_ratio: float
    ideal: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    load_max_over_mean: float
    engine_cpu_ms: float  # the engines' CPU per request
    engines_used: int

    @property
    def of_ideal(self) -> float:
        return self.hit_ratio / self.ideal if self.ideal else float("nan")


def hit_ratio(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> float:
    queried = sum(after[engine][0] - before[engine][0] for engine in after)
    hits = sum(after[engine][1] - before[engine][1] for engine in after)
    return hits / queried if queried else 0.0


def load_max_over_mean(outcomes: list[Outcome], engines: list[str]) -> float:
    """The integral over time of the largest engine's requests in flight over that of the mean."""
    start = min(outcome.submitted for outcome in outcomes)
    end = max(outcome.finished for outcome in outcomes)
    steps = max(1, int((end - start) / SAMPLE_S))
    changes: dict[str, list[int]] = {engine: [0] * (steps + 2) for engine in engines}
    for outcome in outcomes:
        line = changes.setdefault(outcome.engine_id, [0] * (steps + 2))
        line[int((outcome.submitted - start) / SAMPLE_S)] += 1
        line[int((outcome.finished - start) / SAMPLE_S) + 1] -= 1
    loads = {engine: 0 for engine in changes}
    largest = total = 0.0
    for step in range(steps + 1):
        for engine, line in changes.items():
            loads[engine] += line[step]
        largest += max(loads.values())
        total += sum(loads.values()) / len(loads)
    return largest / total if total else float("nan")


def figures(
    run: WorkloadRun,
    policy: str,
    engines: list[str],
    before: dict[str, tuple[int, int]],
    after: dict[str, tuple[int, int]],
    engine_cpu_s: float,
) -> Figures:
    outcomes = run.outcomes
    ttft = sorted((outcome.first_token - outcome.submitted) * 1000 for outcome in outcomes)
    wall = max(outcome.finished for outcome in outcomes) - min(outcome.submitted for outcome in outcomes)
    return Figures(
        run.name,
        policy,
        len(outcomes),
        hit_ratio(before, after),
        run.ideal,
        percentile(ttft, 50),
        percentile(ttft, 99),
        len(outcomes) / wall,
        load_max_over_mean(outcomes, engines),
        engine_cpu_s * 1000 / len(outcomes),
        len({outcome.engine_id for outcome in outcomes}),
    )


TARGETS = (
    ("hit ratio / ideal, grpo", "of_ideal", "grpo", 0.9),
    ("hit ratio / ideal, multi-turn", "of_ideal", "multi-turn", 0.9),
)


def round_ratios(runs: list[Figures], workload: str, field: str) -> list[float]:
    """``cache_aware``'s figure over ``least_loaded``'s, round by round (the runs in order)."""
    mine = [getattr(run, field) for run in runs if run.workload == workload and run.policy == "cache_aware"]
    theirs = [getattr(run, field) for run in runs if run.workload == workload and run.policy == "least_loaded"]
    return [a / b for a, b in zip(mine, theirs, strict=False) if b]


def judge(rows: list[Figures], runs: list[Figures], restart: dict[str, float] | None) -> list[dict[str, Any]]:
    """Each target of the issue for ``cache_aware``, against ``least_loaded`` where it is a ratio
    (``runs``: every run, for the median of the uniform workload's ratios round by round)."""
    mine = {row.workload: row for row in rows if row.policy == "cache_aware"}
    theirs = {row.workload: row for row in rows if row.policy == "least_loaded"}
    verdicts: list[dict[str, Any]] = []

    def verdict(name: str, value: float, bound: float, at_most: bool) -> None:
        met = value <= bound if at_most else value >= bound
        verdicts.append({"name": name, "value": value, "bound": bound, "at_most": at_most, "met": met})

    for name, field, workload, bound in TARGETS:
        if workload in mine:
            verdict(name, getattr(mine[workload], field), bound, at_most=False)
    if "grpo" in mine and "grpo" in theirs:
        verdict("TTFT p50 grpo vs least_loaded", mine["grpo"].ttft_p50_ms / theirs["grpo"].ttft_p50_ms, 0.6, True)
    for workload, row in mine.items():
        verdict(f"load max/mean, {workload}", row.load_max_over_mean, 1.3, at_most=True)
    ratios = round_ratios(runs, "uniform", "requests_per_s")
    if ratios:
        name = f"requests/s uniform vs least_loaded, median of {len(ratios)} rounds"
        verdict(name, statistics.median(ratios), 0.97, at_most=False)
    if restart is not None:
        verdict("multi-turn hit ratio after a restart / before", restart["after"] / restart["before"], 0.8, False)
    return verdicts
