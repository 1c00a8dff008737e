"""The coordinator benchmark's report: the medians, ratios and targets of a summary, printed."""

from __future__ import annotations

import sys
from typing import Any


def print_report(summary: dict[str, Any], out: Any = sys.stdout) -> None:
    medians = summary["medians"]
    out.write("\nmedians over rounds\n")
    for name, entry in medians.get("sequential", {}).items():
        cpu = "  ".join(
            f"{key.removeprefix('cpu_us_per_')} {value:.1f} us"
            for key, value in entry.items()
            if key.startswith("cpu_us_per_") and value >= 0.2  # idle processes left out
        )
        out.write(
            f"  sequential {name:<25} p50 {entry['p50_us']:6.0f} us  p99 {entry['p99_us']:6.0f} us   cpu/req: {cpu}\n"
        )
    for scenario, unit in (("pipelined", "req/s"), ("streaming", "msg/s")):
        for name, entry in medians.get(scenario, {}).items():
            cpu = "  ".join(
                f"{key.removeprefix('cpu_us_per_')} {value:.1f} us"
                for key, value in entry.items()
                if key.startswith("cpu_us_per_") and value >= 0.2  # idle processes left out
            )
            errors = f"  ERRORS {entry['errors']}" if entry["errors"] else ""
            out.write(f"  {scenario:<10} {name:<25} {entry['per_s']:10.0f} {unit}   cpu/msg: {cpu}{errors}\n")
    out.write("\nratios (median of per-round ratios, [min, max])\n")
    for key, value in summary["ratios"].items():
        low, high = summary["ratio_range"][key]
        out.write(f"  {key:<34} {value:7.3f}  [{low:.3f}, {high:.3f}]\n")
    out.write("\ntargets\n")
    for target in summary["targets"].values():
        sign = "<=" if target["at_most"] else ">="
        verdict = "met" if target["met"] else "MISSED"
        out.write(f"  {target['name']:<48} {target['value']:7.3f} (target {sign} {target['bound']:g})  {verdict}\n")
