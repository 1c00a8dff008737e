"""The gateway benchmark's report: the median steps, figures and targets of a summary, printed."""

from __future__ import annotations

import sys
from typing import Any


def print_report(summary: dict[str, Any], out: Any = sys.stdout) -> None:
    out.write("\nmedians over rounds\n")
    out.write(f"  {'step':<20} {'rate/s':>9} {'p50 us':>9} {'p99 us':>9}   CPU us per request (or stream)\n")
    for step, entry in summary["steps"].items():
        rate = f"{entry['per_s']:9.0f}" if "per_s" in entry else f"{'':>9}"
        cpu = ", ".join(f"{name} {value:.0f}" for name, value in entry.get("cpu_us_per", {}).items())
        errors = f"  ERRORS {entry['errors']}" if entry["errors"] else ""
        out.write(f"  {step:<20} {rate} {entry['p50_us']:9.0f} {entry['p99_us']:9.0f}   {cpu}{errors}\n")
    out.write("\nfigures (median of rounds)\n")
    for name, value in summary["figures"].items():
        out.write(f"  {name:<30} {value:10.3f}\n")
    out.write("\ntargets\n")
    for name, target in summary["targets"].items():
        verdict = "met" if target["met"] else "MISSED"
        out.write(
            f"  {name:<30} {target['value']:10.1f} (target {target['sign']} {target['bound']:g}; "
            f"{target['ratio']:.2f} of it)  {verdict}\n"
        )
