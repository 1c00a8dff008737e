"""CPU time of another process, and of the whole machine, read from /proc (Linux)."""

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


def busy_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent busy so far (all processes, /proc/stat)."""
    with open("/proc/stat", "rb") as stat:
        fields = stat.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICKS_PER_SECOND
