"""The coordinator benchmark's figures: each round's ratios of dpcoord to its baselines, the
medians over rounds, and the targets judged on them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Goal:
    """A target ratio: ``value`` must be >= ``bound`` (or <= for ``at_most``)."""

    name: str
    bound: float
    at_most: bool = False

    def met(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound


TARGETS = {
    "pipelined_vs_raw_2hop": Goal("pipelined throughput / raw 2-hop echo", 0.8),
    "sequential_p50_vs_raw_4hop": Goal("sequential p50 / raw 4-hop relay", 1.0, at_most=True),
    "coordinator_cpu_us_per_request": Goal("coordinator CPU per request, pipelined (us)", 10.0, at_most=True),
    "streaming_vs_raw_relay": Goal("streamed partials/s / raw one-way relay", 0.5),
    "long_prompt_vs_short": Goal("throughput 10,000-token / 10-token prompts", 0.7),
}

# name: (scenario, numerator measurement, denominator measurement or None, field); a
# denominator of None reports the numerator's field itself (CPU microseconds per message).
FIGURES: dict[str, tuple[str, str, str | None, str]] = {
    "pipelined_vs_raw_2hop": ("pipelined", "dpcoord", "raw_2hop", "per_s"),
    "pipelined_vs_raw_4hop": ("pipelined", "dpcoord", "raw_4hop", "per_s"),
    "pipelined_plain_vs_raw_2hop": ("pipelined", "dpcoord_plain", "raw_2hop", "per_s"),
    "long_prompt_vs_short": ("pipelined", "dpcoord_long_prompt", "dpcoord", "per_s"),
    "long_prompt_plain_vs_short_plain": ("pipelined", "dpcoord_plain_long_prompt", "dpcoord_plain", "per_s"),
    "raw_4hop_long_prompt_vs_short": ("pipelined", "raw_4hop_long_prompt", "raw_4hop", "per_s"),
    "sequential_p50_vs_raw_4hop": ("sequential", "dpcoord", "raw_4hop", "p50_us"),
    "sequential_p50_vs_raw_2hop": ("sequential", "dpcoord", "raw_2hop", "p50_us"),
    "sequential_plain_p50_vs_raw_4hop": ("sequential", "dpcoord_plain", "raw_4hop", "p50_us"),
    "streaming_vs_raw_relay": ("streaming", "dpcoord_stream", "raw_relay", "per_s"),
    "coordinator_cpu_us_per_request": ("pipelined", "dpcoord", None, "cpu_us_per_coordinator"),
    "coordinator_cpu_us_per_request_plain": ("pipelined", "dpcoord_plain", None, "cpu_us_per_coordinator"),
    "coordinator_cpu_us_per_request_long_prompt": ("pipelined", "dpcoord_long_prompt", None, "cpu_us_per_coordinator"),
    "coordinator_cpu_us_per_partial": ("streaming", "dpcoord_stream", None, "cpu_us_per_coordinator"),
    "raw_relay_cpu_us_per_request": ("pipelined", "raw_4hop", None, "cpu_us_per_raw_relay"),
    "raw_relay_cpu_us_per_request_long_prompt": ("pipelined", "raw_4hop_long_prompt", None, "cpu_us_per_raw_relay"),
    "raw_relay_cpu_us_per_partial": ("streaming", "raw_relay", None, "cpu_us_per_raw_stream_relay"),
}


def _field(measurement: dict[str, Any], name: str) -> float:
    if name.startswith("cpu_us_per_"):
        return measurement["cpu_us_per"][name.removeprefix("cpu_us_per_")]
    return measurement[name]


def round_ratios(measured: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    """The figures of one round, from whatever that round measured."""
    figures: dict[str, float] = {}
    for key, (scenario, numerator, denominator, field_name) in FIGURES.items():
        results = measured.get(scenario, {})
        if numerator not in results or (denominator is not None and denominator not in results):
            continue
        value = _field(results[numerator], field_name)
        figures[key] = value if denominator is None else value / _field(results[denominator], field_name)
    return figures


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds: of each measurement, and of each per-round ratio."""
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for scenario in ("sequential", "pipelined", "streaming"):
        names = {name for r in rounds for name in r["measured"].get(scenario, {})}
        for name in sorted(names):
            values = [r["measured"][scenario][name] for r in rounds if name in r["measured"].get(scenario, {})]
            keys = [key for key in ("p50_us", "p99_us", "per_s") if key in values[0]]
            entry = {key: statistics.median(v[key] for v in values) for key in keys}
            for proc in values[0].get("cpu_us_per", {}):
                entry[f"cpu_us_per_{proc}"] = statistics.median(v["cpu_us_per"][proc] for v in values)
            entry["errors"] = sum(v["errors"] for v in values)
            medians.setdefault(scenario, {})[name] = entry
    ratio_names = {key for r in rounds for key in r["ratios"]}
    ratios = {
        key: statistics.median(r["ratios"][key] for r in rounds if key in r["ratios"]) for key in sorted(ratio_names)
    }
    spread = {
        key: [
            min(r["ratios"][key] for r in rounds if key in r["ratios"]),
            max(r["ratios"][key] for r in rounds if key in r["ratios"]),
        ]
        for key in sorted(ratio_names)
    }
    targets = {
        key: {
            "name": target.name,
            "value": ratios[key],
            "bound": target.bound,
            "at_most": target.at_most,
            "met": target.met(ratios[key]),
        }
        for key, target in TARGETS.items()
        if key in ratios
    }
    return {"medians": medians, "ratios": ratios, "ratio_range": spread, "targets": targets}
