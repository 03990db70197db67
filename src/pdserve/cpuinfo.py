"""This CPU: its feature flags (for choosing among native builds at import) and its name."""

from __future__ import annotations

import platform


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((x for x in info if x.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx_ne_convert")
"""The CPU flags that decide which matmul and attention kernels the engine gets: AVX2 is the
baseline of the native kernels, AVX-512 widens them, and AVX512-BF16, AMX or AVX-NE-CONVERT
give oneDNN native bf16 matmuls (without them ``dtype=auto`` runs float32)."""


def cpu_model() -> str:
    """The CPU's marketing name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def isa_flags() -> tuple[str, ...]:
    """Which of ``ISA_FLAGS`` this CPU has, in that order."""
    flags = cpu_flags()
    return tuple(f for f in ISA_FLAGS if f in flags)
