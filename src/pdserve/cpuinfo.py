"""This CPU's feature flags, for choosing among native builds at import."""

from __future__ import annotations


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((x for x in info if x.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())
