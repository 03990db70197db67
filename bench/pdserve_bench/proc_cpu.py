"""CPU time of other processes, from ``/proc/PID/stat`` (Linux): what the benchmarks charge
to the services they start."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks of ``pid`` so far (its threads, the ended ones too)."""
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) the processes spent so far."""
    return sum(cpu_ticks(pid) for pid in pids) / CLK_TCK
