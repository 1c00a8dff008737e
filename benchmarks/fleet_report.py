"""The fleet-size benchmark's report: a row per fleet and the targets within the run, printed."""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.fleet_bench import UNKNOWN
from benchmarks.fleet_summary import FleetResult


def print_report(
    results: list[FleetResult], verdicts: list[dict[str, Any]], header: str, out: Any = sys.stdout
) -> None:
    out.write(f"\n{header}\n")
    columns = (
        "policy       engines  achieved/s   p50 ms   p99 ms  coord us/req  coord %core  req/msg  kv ev/req  "
        "reg s  reg CPU s  idle %core  lost  dup  errors  engines lost  log lines  others (cores)\n"
    )
    out.write(columns)
    for r in results:
        out.write(
            f"{r.policy:<12} {r.engines:>7}  {r.achieved_per_s:>10,.0f}  {r.p50_ms:>7.2f}  {r.p99_ms:>7.2f}  "
            f"{r.cpu_us_per_request:>12.1f}  {r.coordinator_core_pct:>11.0f}  {r.requests_per_routed_message:>7.1f}  {r.kv_events_per_request:>9.2f}  "
            f"{r.registration_s:>5.2f}  {r.registration_cpu_s:>9.2f}  {r.idle_core_pct:>10.1f}  {r.lost:>4}  {r.duplicated:>3}  "
            f"{r.errors:>6}  {r.engines_lost if r.engines_lost != UNKNOWN else '?':>12}  {r.log_lines:>9}  {r.others_cores:>14.2f}\n"
        )
    out.write("\ntargets (within this run)\n")
    for v in verdicts:
        sign = "<=" if v["at_most"] else ">="
        verdict = "met" if v["met"] else f"MISSED by {abs(v['value'] / v['bound'] - 1) * 100:.0f}%"
        out.write(f"  {v['policy']:<12} {v['name']:<72} {v['value']:8.3f} (target {sign} {v['bound']:g})  {verdict}\n")
        if not v["met"]:
            out.write(f"  {'':<12} why: {v['why']}\n")
