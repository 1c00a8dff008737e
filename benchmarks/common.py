"""What the benchmarks share: where their results go, the machine they ran on, the
nearest-rank percentile of their latencies, another revision's code to measure beside this
checkout's, and how the processes they start are stopped."""

from __future__ import annotations

import asyncio
import math
import os
import platform
import signal
import subprocess
from collections.abc import Iterable
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


def extract(revision: str, into: Path) -> Path:
    """The code of ``revision`` of this checkout that the services run (service, handlers, engines)."""
    repo = Path(__file__).resolve().parents[1]
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", revision, "service", "handlers", "engines"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


async def stop_processes(processes: Iterable[asyncio.subprocess.Process], timeout_s: float) -> None:
    """SIGTERM to every one still running, then each waited for ``timeout_s`` and killed past it."""
    processes = list(processes)
    for process in processes:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            process.kill()
            await process.wait()
