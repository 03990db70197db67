"""``tune_for_streams``: a hand-off's largest buffers come from the heap, which keeps them.

Run in a child interpreter: the thresholds are process-wide and would leak into other tests.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from pdserve.rpc import allocator

_PROBE = textwrap.dedent(
    """
    import ctypes, ctypes.util, json
    from pdserve.rpc import allocator

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)

    def in_heap(nbytes):
        addr = libc.malloc(nbytes)
        with open("/proc/self/maps") as maps:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= addr < hi:
                    return line.rstrip().endswith("[heap]")
        raise SystemExit("malloc'd address not mapped")

    frame = 64 * 1024 * 1024 + 24  # one layer frame of a 32K-token base-preset hand-off
    before = in_heap(frame)
    ok = allocator.tune_for_streams()
    print(json.dumps({"before": before, "ok": ok, "after": in_heap(frame)}))
    """
)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt on Linux only",
)
def test_layer_frames_come_from_the_heap_once_tuned() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    probe = json.loads(out.stdout)
    assert probe["before"] is False  # glibc's default: a fresh mmap for every such buffer
    assert probe["ok"] is True
    assert probe["after"] is True


def test_thresholds_cover_a_32k_base_hand_off() -> None:
    # 24 layers x 2 (K, V) x 32768 tokens x 8 heads x 64 dims x 2 bytes
    payload = 24 * 2 * 32768 * 8 * 64 * 2
    assert payload <= allocator.DEFAULT_TRIM_BYTES
    assert payload // 24 <= allocator.DEFAULT_MMAP_BYTES
