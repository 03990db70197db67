"""The services ``pdserve bench transfer`` runs: a KV store, a decode worker, a layer-wise
and a deferred prefill worker; when nixl is measured, Redis and a scheduler; when mooncake
is, a ``mooncake_master`` and a pair of prefill workers writing into it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.compute.omp import worker_omp_env
from pdserve.errors import WorkerUnavailableError
from pdserve.kvstore.mooncake.master import MasterProcess
from pdserve.launcher import read_heartbeats
from pdserve.redis_server import EmbeddedRedis
from pdserve.service_process import ServiceProcess, healthy, terminate
from pdserve_bench.proc_cpu import cpu_s

_MIB = 1024 * 1024
MOONCAKE = "mooncake"
"""The ``store`` transport into a Mooncake Store instead of pdserve's KV store: its own pair
of prefill workers (``--kvstore mooncake://...``, each lending ``MOONCAKE_SEGMENT``) beside the
others, and the same decode worker, which reads from whichever store a handle names."""
MOONCAKE_SEGMENT = "1GiB"


@dataclass
class Services:
    """KV store, decode worker, layer-wise and deferred prefill workers; with ``redis``, a
    scheduler too (nixl: the decode worker finds the prefill workers' NIXL agents in their
    heartbeats, and a prefill worker with Redis sends to a decode worker only under a
    reservation, so every sample is assigned one)."""

    processes: list[ServiceProcess]
    redis: EmbeddedRedis | None = None
    master: MasterProcess | None = None

    def address(self, name: str) -> str:
        return next(p for p in self.processes if p.name == name).address

    @property
    def scheduler(self) -> str:
        return self.address("scheduler") if self.redis is not None else ""

    @classmethod
    def start(
        cls,
        model: Path,
        log_dir: Path,
        worker_args: Sequence[str],
        *,
        redis: bool = False,
        mooncake: bool = False,
    ) -> Services:
        env = {**worker_omp_env(), "PYTHONUNBUFFERED": "1"}
        embedded = EmbeddedRedis().start() if redis else None
        if embedded is not None:
            env["PDSERVE_REDIS_URL"] = embedded.url

        def proc(name: str, module: str, args: list[str]) -> ServiceProcess:
            return ServiceProcess(
                name, module, args, log_dir / f"{name}.port", log_dir / f"{name}.log"
            )

        store = proc("kvstore", "services.kvstore", ["--capacity-bytes", str(8 * 1024 * _MIB)])
        first = [store]
        if embedded is not None:
            first.append(proc("scheduler", "services.scheduler", ["--log-level", "WARNING"]))
        for p in first:
            p.spawn(env)
        wait_for(first)
        common = ["--model", str(model), "--kvstore", store.address, *worker_args]
        workers = [
            proc("decode", "services.decode", common),
            proc("prefill", "services.prefill", common),
            proc("prefill-deferred", "services.prefill", [*common, "--no-layerwise"]),
        ]
        master = MasterProcess().start() if mooncake else None
        if master is not None:
            moon = [*common, "--kvstore", master.address(segment=MOONCAKE_SEGMENT)]
            workers += [
                proc(f"prefill-{MOONCAKE}", "services.prefill", moon),
                proc(f"prefill-{MOONCAKE}-deferred", "services.prefill", [*moon, "--no-layerwise"]),
            ]
        for w in workers:
            w.spawn(env)
        wait_for(workers)
        if embedded is not None:  # the scheduler places only on workers it has heard from
            deadline = time.monotonic() + 60
            while len(read_heartbeats(embedded.url)) < len(workers):
                if time.monotonic() > deadline:
                    raise WorkerUnavailableError("the workers' heartbeats did not arrive")
                time.sleep(0.1)  # polling heartbeats: nothing to block on
        return cls([*first, *workers], embedded, master)

    def cpu_s(self) -> float:
        """CPU seconds the services' processes have spent so far (the store, scheduler and
        workers; not Redis or a Mooncake master, which carry no KV bytes)."""
        return cpu_s([p.proc.pid for p in self.processes if p.proc is not None])

    def stop(self) -> None:
        terminate([p.proc for p in self.processes if p.proc is not None], 10.0)
        if self.redis is not None:
            self.redis.stop()
        if self.master is not None:
            self.master.stop()


def wait_for(procs: list[ServiceProcess], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while not (p.read_port() and healthy(p.address)):
            p.check_alive()
            if time.monotonic() > deadline:
                raise WorkerUnavailableError(f"{p.name} did not start; see {p.log_file}")
            time.sleep(0.1)  # polling a child's port file: nothing to block on
