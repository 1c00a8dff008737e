"""The fleet-size benchmark's targets: each judged per policy against the smallest fleet of
the run, with the facts that explain a miss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.fleet_summary import FleetResult


@dataclass(frozen=True, slots=True)
class Goal:
    name: str
    engines: int
    bound: float
    at_most: bool

    def met(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound


# Against the smallest fleet of the run (2 engines by default).
RATIO_GOALS = (
    Goal("coordinator CPU per request vs 2 engines", 1000, 1.2, at_most=True),
    Goal("coordinator CPU per request vs 2 engines", 3000, 1.5, at_most=True),
    Goal("throughput vs 2 engines", 1000, 0.95, at_most=False),
)
REGISTRATION_CPU_GOAL = Goal("coordinator CPU to register the fleet (s)", 3000, 0.1, at_most=True)
IDLE_GOAL = Goal("idle coordinator CPU with the fleet heartbeating (% of a core)", 3000, 5.0, at_most=True)


def judge(results: list[FleetResult]) -> list[dict[str, Any]]:
    """Each target per policy: value, bound, met, and the facts that explain a miss."""
    verdicts: list[dict[str, Any]] = []
    for policy in dict.fromkeys(result.policy for result in results):
        rows = {result.engines: result for result in results if result.policy == policy}
        base = rows[min(rows)]
        for goal in RATIO_GOALS:
            row = rows.get(goal.engines)
            if row is None or row is base:
                continue
            cpu = "CPU" in goal.name
            value = row.cpu_ratio if cpu else row.rate_ratio
            why = (
                f"{base.cpu_us_per_request:.1f} -> {row.cpu_us_per_request:.1f} us/request; requests per routed message "
                f"{base.requests_per_routed_message:.1f} -> {row.requests_per_routed_message:.1f}; KV events per "
                f"request {base.kv_events_per_request:.2f} -> {row.kv_events_per_request:.2f}"
                if cpu
                else f"{base.achieved_per_s:,.0f} -> {row.achieved_per_s:,.0f} req/s of {row.offered_per_s:,.0f} offered; "
                f"coordinator at {row.coordinator_core_pct:.0f}% of a core; other processes {row.others_cores:.2f} cores; "
                f"{row.engines_lost} engines removed for silence"
            )
            verdicts.append(
                _verdict(policy, goal, f"{goal.name} ({goal.engines} / {base.engines} engines)", value, why)
            )
        for goal, field_name in ((REGISTRATION_CPU_GOAL, "registration_cpu_s"), (IDLE_GOAL, "idle_core_pct")):
            row = rows.get(goal.engines)
            if row is not None:
                why = f"registration took {row.registration_s:.2f} s wall; {row.log_lines} coordinator log lines in the run"
                verdicts.append(
                    _verdict(policy, goal, f"{goal.name}, {goal.engines} engines", getattr(row, field_name), why)
                )
    return verdicts


def _verdict(policy: str, goal: Goal, name: str, value: float, why: str) -> dict[str, Any]:
    return {
        "policy": policy,
        "name": name,
        "value": value,
        "bound": goal.bound,
        "at_most": goal.at_most,
        "met": goal.met(value),
        "why": why,
    }
