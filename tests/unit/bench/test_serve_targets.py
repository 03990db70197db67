"""RouterTarget keeps its cluster's resident memory for the report, which is written after
the clusters stop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass, field

from pdserve_bench.serve.targets import RouterTarget


@dataclass
class _Service:
    name: str
    proc: subprocess.Popen[bytes]


@dataclass
class _Cluster:
    services: list[_Service] = field(default_factory=list)


def test_rss_outlives_the_cluster() -> None:
    # 20 MB touched before it says so: resident whatever the interpreter's own size.
    code = "import sys, time; b = bytearray(20_000_000); print('ok', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ok\n"
        cluster = _Cluster([_Service("decode-0", child)])
        target = RouterTarget("127.0.0.1:1", "t", cluster=cluster)  # type: ignore[arg-type]
        live = target.describe()["rss_mb"]
        assert live["decode-0"] >= 20
        asyncio.run(target.close())
    finally:
        child.kill()
        child.wait()
    after = target.describe()["rss_mb"]  # the process is gone: the figure taken at close
    assert after["decode-0"] >= 20
