"""When a trainer process started: the first mark of a start-up's cost breakdown (`startup` in the first
metrics record of each process). No torch here: the warm launcher (kiln.cli.warm) imports it."""

from __future__ import annotations

import os

PROCESS_START_ENV = "KILN_PROCESS_START"  # a rank forked by kiln.cli.warm: its launcher's start, epoch seconds


def process_start_time() -> float | None:
    """When this process was started (epoch seconds; None where there is no /proc), or for a rank forked here
    its launcher's: the first mark of a start-up's cost breakdown (`startup` in each process's first record)."""
    if os.environ.get(PROCESS_START_ENV):
        return float(os.environ[PROCESS_START_ENV])
    try:
        with open("/proc/self/stat") as f:  # field 22, after the parenthesised name: start time in clock ticks
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
