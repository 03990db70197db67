"""``freeze_startup_heap``: what a service built before serving leaves the garbage collector's
scans; what it builds later is still scanned and collected.

Run in a child interpreter: the freeze is process-wide and would reach into other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent(
    """
    import gc, json
    from pdserve.rpc.server import freeze_startup_heap

    class Node:
        pass

    early = Node()
    early.me = early  # a cycle, as start-up leaves many
    frozen = freeze_startup_heap()
    late = Node()
    late.me = late
    scanned = {id(o) for o in gc.get_objects()}
    garbage = Node()
    garbage.me = garbage
    del garbage
    print(json.dumps({
        "frozen": frozen,
        "early_scanned": id(early) in scanned,
        "late_scanned": id(late) in scanned,
        "collected": gc.collect(),
    }))
    """
)


def test_start_up_objects_leave_the_scans_and_later_garbage_is_still_collected() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    got = json.loads(out.stdout)
    assert got["frozen"] > 1000  # grpc, protobuf and pdserve's modules at least
    assert not got["early_scanned"]
    assert got["late_scanned"]
    assert got["collected"] >= 1  # the cycle made after the freeze
