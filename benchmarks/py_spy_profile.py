"""Sample a running process with py-spy and say where its time goes.

py-spy (``pip install py-spy``, in the ``bench`` extra) samples another process without
changing it; ``--nonblocking`` keeps it from pausing the coordinator while sampling. Its
``raw`` output is one collapsed stack per line (``outer;...;inner count``), which this module
folds into self time (the innermost frame) and inclusive time (every frame on the stack).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_LINE_NUMBER = re.compile(r":\d+\)$")


def py_spy_binary() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def record(pid: int, seconds: float, output: Path, rate: int = 500) -> asyncio.subprocess.Process:
    """Start sampling ``pid`` for ``seconds``; await the returned process's ``wait()`` for the file."""
    binary = py_spy_binary()
    if binary is None:
        raise FileNotFoundError("py-spy not found: pip install 'dpcoord[bench]' (or pip install py-spy)")
    return await asyncio.create_subprocess_exec(
        binary,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(seconds))),
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--nonblocking",
        "--output",
        str(output),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


@dataclass(slots=True)
class Profile:
    samples: int
    self_time: Counter[str]
    inclusive: Counter[str]

    def table(self, top: int = 20) -> list[tuple[str, float, float]]:
        """(frame, self %, inclusive %) for the frames with most self time."""
        total = max(self.samples, 1)
        return [
            (frame, 100 * count / total, 100 * self.inclusive[frame] / total)
            for frame, count in self.self_time.most_common(top)
        ]

    def inclusive_table(self, top: int = 25) -> list[tuple[str, float]]:
        total = max(self.samples, 1)
        return [(frame, 100 * count / total) for frame, count in self.inclusive.most_common(top)]


def _frame_name(frame: str) -> str:
    """``fn (path/to/module.py:123)`` -> ``fn (module.py)``: lines of one function add up."""
    frame = _LINE_NUMBER.sub(")", frame.strip())
    name, _, location = frame.partition(" (")
    if location:
        location = location.rstrip(")")
        parts = Path(location).parts
        location = "/".join(parts[-2:]) if len(parts) >= 2 else location
        return f"{name} ({location})"
    return name


def fold(collapsed: str) -> Profile:
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [name for name in (_frame_name(frame) for frame in stack.split(";")) if name]
        if not frames:
            continue
        samples += count
        self_time[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return Profile(samples, self_time, inclusive)
