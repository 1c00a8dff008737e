"""The fleet-size benchmark's results: per fleet, the medians over its load windows and the
per-round ratios to the smallest fleet."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from benchmarks.fleet_bench import RunningFleet


@dataclass(slots=True)
class FleetResult:
    """One fleet: registration and idle figures, and medians over the rounds of load windows."""

    policy: str
    engines: int
    registration_s: float
    registration_cpu_s: float
    idle_core_pct: float
    offered_per_s: float
    achieved_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float
    coordinator_core_pct: float
    requests_per_routed_message: float
    kv_events_per_request: float  # KV events the coordinator applied per request routed
    others_cores: float  # CPU of every other process on the machine over the load windows, in cores
    sent: int  # sums over the rounds
    lost: int
    duplicated: int
    errors: int
    engines_lost: int  # most engines missing from the coordinator's pool after a window (removed for silence); UNKNOWN if it never answered
    log_lines: int
    cpu_ratio: float = float("nan")  # median over rounds of CPU per request / the smallest fleet's in that round
    rate_ratio: float = float("nan")  # same, of the achieved rate


def summarise(fleets: list[RunningFleet], rate: float) -> list[FleetResult]:
    """Medians over rounds per fleet, and per-round ratios to the smallest fleet's window."""
    base = min(fleets, key=lambda fleet: fleet.engines)
    results = []
    for fleet in fleets:
        windows = fleet.windows

        def median(key: str, of: list[dict[str, float]] = windows) -> float:
            return statistics.median(window[key] for window in of)

        def ratio(key: str, fleet: RunningFleet = fleet) -> float:
            return statistics.median(
                mine[key] / theirs[key] for mine, theirs in zip(fleet.windows, base.windows, strict=True)
            )

        results.append(
            FleetResult(
                policy=fleet.policy,
                engines=fleet.engines,
                registration_s=fleet.registration_s,
                registration_cpu_s=fleet.registration_cpu_s,
                idle_core_pct=fleet.idle_core_pct,
                offered_per_s=rate,
                achieved_per_s=median("achieved_per_s"),
                p50_ms=median("p50_ms"),
                p99_ms=median("p99_ms"),
                cpu_us_per_request=median("cpu_us_per_request"),
                coordinator_core_pct=median("coordinator_core_pct"),
                requests_per_routed_message=median("requests_per_routed_message"),
                kv_events_per_request=median("kv_events_per_request"),
                others_cores=median("others_cores"),
                sent=sum(int(w["sent"]) for w in windows),
                lost=sum(int(w["lost"]) for w in windows),
                duplicated=sum(int(w["duplicated"]) for w in windows),
                errors=sum(int(w["errors"]) for w in windows),
                engines_lost=max(int(w["engines_lost"]) for w in windows),
                log_lines=len(fleet.log_path.read_text().splitlines()),
                cpu_ratio=ratio("cpu_us_per_request"),
                rate_ratio=ratio("achieved_per_s"),
            )
        )
    return results
