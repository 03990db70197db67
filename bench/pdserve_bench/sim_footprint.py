"""``pdserve bench sim-footprint``: what a simulated worker costs the machine it runs on.

For each cluster size N it starts a local cluster of N sim workers (half prefill, half
decode, the real Redis, KV store, scheduler and router), serves a burst of requests through
it (so every worker has stepped, handed off and heartbeated), lets it sit idle, and reports
per worker: resident memory (RSS), proportional memory (PSS: shared library pages split
among the processes mapping them, the figure that adds up to the machine's use) and the
share of a core spent idle (heartbeats, KV events, janitor), plus start-up time and the
machine's available memory before and after, and how many workers have torch mapped (none:
a sim worker imports no torch). This is the figure that says how many simulated accelerators
fit on one host.

``--imports`` breaks a worker's resident memory down by what it imports: a fresh
interpreter imports the worker's dependencies one after another, then the worker's own
modules (``IMPORT_STEPS``), and reports the RSS after each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.sim.flags import DEFAULT_PROFILE
from pdserve_bench.engine_bench import load_average, machine_info
from pdserve_bench.proc_cpu import CLK_TCK, cpu_ticks


@dataclass(frozen=True, slots=True)
class Footprint:
    """One cluster size's figures."""

    workers: int
    startup_s: float
    served: int
    """Requests of the burst that completed."""
    rss_mb_median: float
    rss_mb_max: float
    pss_mb_median: float
    idle_core_pct_median: float
    idle_core_pct_max: float
    available_gb_before: float
    available_gb_after: float
    with_torch: int = 0
    """Workers with a torch library in their memory map."""


def _kb(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def _maps_torch(pid: int) -> bool:
    return any(
        "libtorch" in line or "/torch/" in line
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
    )


def _available_gb() -> float:
    return _kb(Path("/proc/meminfo"), "MemAvailable:") / 1024**2


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if s else 0.0


async def _burst(address: str, n: int, prompt_len: int, max_tokens: int) -> int:
    from pdserve.client import AsyncClient

    async with AsyncClient(address, timeout=300) as client:
        done = await asyncio.gather(
            *(
                client.generate(
                    [16 + (i * 7 + j) % 2000 for j in range(prompt_len)],
                    max_tokens=max_tokens,
                    ignore_eos=True,
                )
                for i in range(n)
            ),
            return_exceptions=True,
        )
    return sum(1 for d in done if not isinstance(d, BaseException))


def measure(
    model: Path, n: int, profile: str, idle_s: float, burst: int, log_dir: Path | None
) -> Footprint:
    from pdserve.launcher import Cluster

    before = _available_gb()
    started = time.perf_counter()
    with Cluster(
        model, backend="sim", mode="disaggregated", num_prefill=n // 2, num_decode=n - n // 2,
        worker_args=["--sim-profile", profile], log_level="WARNING", startup_timeout_s=900.0,
        log_dir=log_dir,
    ) as cluster:  # fmt: skip
        startup = time.perf_counter() - started
        served = asyncio.run(_burst(cluster.router_address, burst, 200, 32))
        pids = [s.proc.pid for s in cluster.workers() if s.proc is not None]
        ticks = {pid: cpu_ticks(pid) for pid in pids}
        t0 = time.perf_counter()
        time.sleep(idle_s)  # the idle window being measured, not synchronisation
        span = time.perf_counter() - t0
        idle = [100.0 * (cpu_ticks(p) - ticks[p]) / CLK_TCK / span for p in pids]
        rss = [_kb(Path(f"/proc/{p}/status"), "VmRSS:") / 1024 for p in pids]
        pss = [_kb(Path(f"/proc/{p}/smaps_rollup"), "Pss:") / 1024 for p in pids]
        with_torch = sum(_maps_torch(p) for p in pids)
        after = _available_gb()
    return Footprint(
        n, round(startup, 1), served, round(_median(rss), 1), round(max(rss), 1),
        round(_median(pss), 1), round(_median(idle), 2), round(max(idle), 2),
        round(before, 2), round(after, 2), with_torch,
    )  # fmt: skip


IMPORT_STEPS = (
    ("numpy", "numpy"),
    ("grpc", "grpc"),
    ("redis", "redis"),
    # The gRPC instrumentation and the OTLP exporter load only where tracing is on.
    ("opentelemetry", "opentelemetry.sdk.trace"),
    ("prometheus_client", "prometheus_client"),
    ("tokenizers", "tokenizers"),
    ("pdserve worker", "services.prefill.__main__, services.decode.__main__, pdserve.sim.backend"),
)  # fmt: skip
"""(label, modules) in the order ``--imports`` takes them: each step's figure is what it
adds to the steps before it (a module the earlier ones imported already costs nothing)."""

_IMPORT_PROBE = """
import json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
out = [("python", rss())]
for label, modules in json.loads(sys.argv[1]):
    exec("import " + modules)
    out.append((label, rss()))
out.append(("torch loaded", "torch" in sys.modules))
print(json.dumps(out))
"""


def import_costs() -> list[tuple[str, float]]:
    """RSS (MB) of a fresh interpreter after each of ``IMPORT_STEPS``, cumulative; the
    last entry says whether torch was loaded (as 1.0 or 0.0)."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, json.dumps(IMPORT_STEPS)],
        capture_output=True, text=True, check=True, env=os.environ,
    )  # fmt: skip
    return [(label, float(mb)) for label, mb in json.loads(done.stdout)]


def print_import_costs() -> list[tuple[str, float]]:
    """Measure and print ``import_costs``; returns them."""
    rows = import_costs()
    *steps, (_, torch_loaded) = rows
    print("RSS of a fresh interpreter importing a sim worker's modules, step by step:")
    previous = 0.0
    for label, mb in steps:
        print(f"  {label:<20} {mb:6.1f} MB  (+{mb - previous:5.1f})")
        previous = mb
    print(f"  torch loaded: {'yes' if torch_loaded else 'no'}")
    return rows


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench sim-footprint", description=__doc__)
    p.add_argument("--sizes", default="16,32,64", help="cluster sizes (workers), comma-separated")
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--idle-s", type=float, default=20.0, help="idle window measured")
    p.add_argument("--burst", type=int, default=64, help="requests served before idling")
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the tiny demo model)")
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument(
        "--imports", action="store_true", help="also break a worker's RSS down by its imports"
    )
    args = p.parse_args(list(argv))
    from pdserve.launcher import default_model

    model = args.model or default_model("tiny")
    machine = {**machine_info(), "load_1min": load_average()}
    print(f"machine: {json.dumps(machine)}", flush=True)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        print(f"starting {n} sim workers ...", flush=True)
        log_dir = args.log_dir / f"{n}w" if args.log_dir else None
        row = measure(model, n, args.profile, args.idle_s, args.burst, log_dir)
        rows.append(row)
        print(
            f"{n:>3} workers: start {row.startup_s:.0f} s, served {row.served}/{args.burst}; "
            f"per worker RSS {row.rss_mb_median:.0f} MB (max {row.rss_mb_max:.0f}), "
            f"PSS {row.pss_mb_median:.0f} MB, idle {row.idle_core_pct_median:.2f}% of a core "
            f"(max {row.idle_core_pct_max:.2f}%); available memory "
            f"{row.available_gb_before:.1f} -> {row.available_gb_after:.1f} GB; "
            f"{row.with_torch} with torch mapped",
            flush=True,
        )
    imports = print_import_costs() if args.imports else []
    if args.json is not None:
        report = {"machine": machine, "rows": [asdict(r) for r in rows], "imports_rss_mb": imports}
        args.json.write_text(json.dumps(report, indent=2))
    return 0
