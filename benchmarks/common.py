"""What the coordinator, gateway and fleet benchmarks share: where their results go, the
machine they ran on, and the nearest-rank percentile of their latencies."""

from __future__ import annotations

import math
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("benchmarks") / "results"  # relative to where it runs: the repository root, git-ignored


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values (NaN for none)."""
    if not sorted_values:
        return float("nan")
    rank = math.ceil(pct / 100 * len(sorted_values))
    return sorted_values[min(len(sorted_values), max(1, rank)) - 1]


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nats_py": metadata.version("nats-py"),
        "msgspec": metadata.version("msgspec"),
        "load_average_at_start": os.getloadavg(),
    }
