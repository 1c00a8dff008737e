"""CPU time of another process, read from its own accounting in /proc (Linux)."""

from __future__ import annotations

import os

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds that ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        raw = stat.read()
    # The command name (field 2) may hold spaces; fields after its closing paren are fixed.
    fields = raw[raw.rindex(b")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _TICKS_PER_SECOND
