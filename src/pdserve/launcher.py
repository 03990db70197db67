"""A whole pdserve cluster on one machine: ``pdserve up`` and the ``Cluster`` tests reuse.

``Cluster.start()`` brings the services up in dependency order, each a child process on a free
port (``--port 0 --port-file F``)::

    Redis (embedded, unless a URL is given)
      -> KVStore, Scheduler
      -> N prefill + M decode workers (colocated: M mixed workers; conditional: N prefill +
         M mixed workers, the scheduler choosing per request), Router

and returns once every service's gRPC health check says SERVING and every worker's heartbeat
is in Redis. ``stop()`` stops them in reverse order: SIGTERM, a grace period, then SIGKILL.
Children also get ``PR_SET_PDEATHSIG``, so none outlives a launcher that is killed outright.

Telemetry: every service serves Prometheus ``/metrics`` on its own port (``metrics_urls()``;
free ports unless ``metrics_base_port`` is given) and traces into the OTLP collector at
``otlp_endpoint`` and/or the shared span file ``trace_file`` (``pdserve trace report
--span-file``); with neither, and no ``OTEL_*`` variables, nothing is traced.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import cast

from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.redis_server import EmbeddedRedis
from pdserve.scheduling import KeySpace, WorkerInfo
from pdserve.scheduling.keys import text
from pdserve.service_process import HOST, ServiceProcess, healthy, terminate
from pdserve.telemetry.service import describe_telemetry
from pdserve.telemetry.tracing import ENV_OTLP_ENDPOINT, ENV_SERVICE_NAME, ENV_SPAN_FILE

DEFAULT_MODEL_ROOT = Path.home() / ".cache" / "pdserve" / "models"
MODES = ("disaggregated", "colocated", "conditional")
"""Cluster kinds: prefill + decode workers, mixed workers only, or prefill + mixed workers."""
_POLL_S = 0.05
"""Interval of readiness polls (port files, health, heartbeats): child processes offer nothing
to block on."""


def read_heartbeats(redis_url: str, namespace: str = "pdserve") -> list[WorkerInfo]:
    """Live worker heartbeats, read with a plain synchronous Redis client."""
    import redis  # the sync client; the scheduling package uses redis.asyncio

    keys = KeySpace(namespace)
    client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        ids = [text(i) for i in cast(list[bytes], client.zrange(keys.worker_index, 0, -1))]
        raws = client.mget([keys.worker(i) for i in ids]) if ids else []
    finally:
        client.close()
    return [WorkerInfo.from_json(raw) for raw in raws if raw is not None]


@dataclass
class Cluster:
    """Redis, KVStore, Scheduler, Router and workers as local child processes.

    ``with Cluster(model_dir, num_prefill=2, num_decode=2) as c: Client(c.router_address)``.
    ``worker_args`` are extra flags for every worker (``["--dtype", "float32"]``),
    ``scheduler_args`` for the scheduler. ``env`` is added to every service's environment
    (``OTEL_*`` settings, for instance); ``trace_file`` and ``otlp_endpoint`` turn tracing on.
    """

    model_dir: Path
    num_prefill: int = 1
    num_decode: int = 1
    mode: str = "disaggregated"
    redis_url: str | None = None
    router_port: int = 0
    namespace: str = "pdserve"
    worker_args: Sequence[str] = ()
    scheduler_args: Sequence[str] = ()
    """Extra flags for the scheduler (``["--policy", "round_robin"]``)."""
    router_args: Sequence[str] = ()
    """Extra flags for the router."""
    planner: bool = False
    """Start the P:D planner (``services.planner``), which moves mixed workers between
    prefill and decode duty."""
    planner_args: Sequence[str] = ()
    duties: Sequence[str] = ()
    """Initial duty of each mixed worker, in order (``--duty``); missing: everything."""
    lanes: Sequence[str] = ()
    """Prefill lane of each prefill worker, in order (``--lane``); missing: any."""
    startup_timeout_s: float = 180.0
    stop_grace_s: float = 10.0
    log_dir: Path | None = None
    log_level: str = "INFO"
    env: Mapping[str, str] = field(default_factory=dict)
    trace_file: Path | None = None
    """Every service appends its finished spans here (``PDSERVE_SPAN_FILE``)."""
    otlp_endpoint: str | None = None
    """OTLP gRPC collector for the traces, e.g. ``http://localhost:4317``."""
    metrics_base_port: int = 0
    """First ``/metrics`` port (one per service, in start order); 0: free ports."""
    host_lease: bool = True
    """The workers share this host's cores through a ``HostLease`` (one engine step at a
    time, decode steps first) instead of oversubscribing them."""
    services: list[ServiceProcess] = field(default_factory=list, init=False)
    metrics_ports: dict[str, int] = field(default_factory=dict, init=False)
    """Service name -> its bound ``/metrics`` port, once started."""
    _redis: EmbeddedRedis | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if self.mode not in MODES:
            raise InvalidArgumentError("mode", f"must be one of {MODES}, got {self.mode!r}")
        if self.mode == "disaggregated" and self.num_prefill < 1:
            raise InvalidArgumentError("num_prefill", "disaggregated mode needs a prefill worker")
        if self.num_decode < 1:
            raise InvalidArgumentError("num_decode", "needs at least one decode (or mixed) worker")
        if not 0 <= self.metrics_base_port <= 65535:
            raise InvalidArgumentError(
                "metrics_base_port", f"must be in [0, 65535], got {self.metrics_base_port}"
            )
        if self.trace_file is not None:
            self.trace_file = Path(self.trace_file)

    # -- addresses -----------------------------------------------------------------------------

    def _service(self, name: str) -> ServiceProcess:
        for s in self.services:
            if s.name == name:
                return s
        raise WorkerUnavailableError(f"no service named {name!r} in this cluster")

    @property
    def router_address(self) -> str:
        return self._service("router").address

    @property
    def scheduler_address(self) -> str:
        return self._service("scheduler").address

    @property
    def kvstore_address(self) -> str:
        return self._service("kvstore").address

    def metrics_urls(self) -> dict[str, str]:
        """Service name -> ``http://127.0.0.1:PORT/metrics``, in start order."""
        ports = self.metrics_ports
        return {
            s.name: f"http://{HOST}:{ports[s.name]}/metrics"
            for s in self.services
            if s.name in ports
        }

    def child_env(self) -> dict[str, str]:
        """The environment every service starts with."""
        # Several engines share this host's cores. OpenMP threads that spin while idle would
        # steal them from the busy engine (measured here: decode 3x slower), so idle
        # threads sleep instead, unless the caller chose otherwise.
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        # One name for all would merge the services into one in the trace backend; each
        # names itself instead.
        env.pop(ENV_SERVICE_NAME, None)
        if self.trace_file is not None:
            env[ENV_SPAN_FILE] = str(self.trace_file.resolve())
        if self.otlp_endpoint is not None:
            env[ENV_OTLP_ENDPOINT] = self.otlp_endpoint
        return env

    def workers(self, role: str | None = None) -> list[ServiceProcess]:
        """Worker processes, all or of one role."""
        return [s for s in self.services if s.role is not None and (role is None or s.role == role)]

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start everything and wait until it is ready; on failure stop what was started."""
        try:
            self._start()
        except BaseException:
            self.stop(keep_logs=True)  # the error names the log dir
            raise
        return self

    def _start(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        if self.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-cluster-")
            self.log_dir = Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.redis_url is None:
            self._redis = EmbeddedRedis().start()
            self.redis_url = self._redis.url
        redis_url = self.redis_url
        env = self.child_env()
        common = ["--log-level", self.log_level]

        kvstore = self._add("kvstore", "services.kvstore", common)
        scheduler = self._add(
            "scheduler", "services.scheduler",
            [*common, "--redis-url", redis_url, "--namespace", self.namespace,
             "--default-mode", self.mode, *self.scheduler_args],
        )  # fmt: skip
        for s in (kvstore, scheduler):
            s.spawn(env)
        self._wait("port files", [kvstore, scheduler], self._read_ports, deadline)

        worker_common = [
            *common, "--model", str(self.model_dir), "--redis-url", redis_url,
            "--namespace", self.namespace, "--kvstore", kvstore.address,
            *(["--host-lease", str(self.log_dir / "host-lease")] if self.host_lease else []),
            *self.worker_args,
        ]  # fmt: skip
        prefills = (
            [] if self.mode == "colocated" else [("prefill", i) for i in range(self.num_prefill)]
        )
        second = "decode" if self.mode == "disaggregated" else "mixed"
        roles = prefills + [(second, i) for i in range(self.num_decode)]
        duties = list(self.duties)

        def role_args(role: str, i: int) -> list[str]:
            if role == "prefill":
                lane = self.lanes[i] if i < len(self.lanes) else ""
                return ["--lane", lane] if lane else []
            if role != "mixed":
                return []
            duty = duties[i] if i < len(duties) and duties[i] else None
            return ["--role", "mixed", *(["--duty", duty] if duty else [])]

        late = [
            self._add(
                f"{role}-{i}",
                f"services.{'decode' if role == 'mixed' else role}",
                [*worker_common, *role_args(role, i)],
                role=role,
            )
            for role, i in roles
        ]
        if self.planner:
            late.append(self._add(
                "planner", "services.planner",
                [*common, "--redis-url", redis_url, "--namespace", self.namespace,
                 *self.planner_args],
            ))  # fmt: skip
        router = self._add(
            "router", "services.router",
            [*common, "--scheduler", scheduler.address, "--model", str(self.model_dir),
             "--mode", self.mode, "--redis-url", redis_url, "--namespace", self.namespace,
             *self.router_args],
        )  # fmt: skip
        if self.router_port:
            router.args += ["--port", str(self.router_port)]  # the last --port wins
        for s in [*late, router]:
            s.spawn(env)
        self._wait("port files", [*late, router], self._read_ports, deadline)
        self._wait("health checks", self.services, lambda s: healthy(s.address), deadline)
        self._wait_heartbeats(deadline)

    def _add(
        self, name: str, module: str, args: list[str], role: str | None = None
    ) -> ServiceProcess:
        assert self.log_dir is not None  # set by _start before any service is added
        base = self.metrics_base_port
        metrics = ["--metrics-port", str(base + len(self.services) if base else 0),
                   "--metrics-port-file", str(self._metrics_port_file(name))]  # fmt: skip
        service = ServiceProcess(
            name, module, [*args, *metrics],
            port_file=self.log_dir / f"{name}.port",
            log_file=self.log_dir / f"{name}.log",
            role=role,
        )  # fmt: skip
        self.services.append(service)
        return service

    def _metrics_port_file(self, name: str) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{name}.metrics-port"

    def _read_ports(self, service: ServiceProcess) -> bool:
        """True once the service wrote its gRPC port (its metrics port file came first)."""
        if not service.read_port():
            return False
        if service.name not in self.metrics_ports:
            path = self._metrics_port_file(service.name)
            self.metrics_ports[service.name] = int(path.read_text().strip())
        return True

    def _wait(
        self,
        what: str,
        services: Sequence[ServiceProcess],
        ready: Callable[[ServiceProcess], bool],
        deadline: float,
    ) -> None:
        pending = list(services)
        while pending:
            for s in pending:
                s.check_alive()
            pending = [s for s in pending if not ready(s)]
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {s.name}:\n{s.log_tail(10)}" for s in pending)
                raise WorkerUnavailableError(
                    f"timed out waiting for {what} of {', '.join(s.name for s in pending)}; "
                    f"logs in {self.log_dir}\n{tails}"
                )
            time.sleep(_POLL_S)

    def _wait_heartbeats(self, deadline: float) -> None:
        assert self.redis_url is not None
        redis_url = self.redis_url

        def beating(s: ServiceProcess) -> bool:
            port = f":{s.port}"
            return any(
                w.role.value == s.role and w.address.endswith(port)
                for w in read_heartbeats(redis_url, self.namespace)
            )

        self._wait("heartbeats", self.workers(), beating, deadline)

    def stop(self, *, keep_logs: bool = False) -> None:
        """Stop every service, router first and Redis last. Idempotent.

        A temporary log dir is deleted unless ``keep_logs``."""
        tiers = [
            [s for s in self.services if s.name in ("router", "planner")],
            self.workers(),
            [s for s in self.services if s.name in ("scheduler", "kvstore")],
        ]
        for tier in tiers:
            terminate([s.proc for s in tier if s.proc is not None], self.stop_grace_s)
        self.services.clear()
        self.metrics_ports.clear()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
            self.redis_url = None
        if self._tmp is not None and not keep_logs:
            self._tmp.cleanup()
            self._tmp = None
            self.log_dir = None

    def failed(self) -> list[ServiceProcess]:
        """Services whose process has exited."""
        return [s for s in self.services if s.proc is not None and s.proc.poll() is not None]

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# -- pdserve up ----------------------------------------------------------------------------------


def default_model(preset: str) -> Path:
    """The demo checkpoint of ``preset`` under ~/.cache/pdserve/models, made on first use."""
    path = DEFAULT_MODEL_ROOT / f"demo-{preset}"
    if not (path / "config.json").is_file():
        from pdserve.models.demo import init_checkpoint  # imports torch: only when needed

        print(f"creating the {preset} demo checkpoint in {path} (first run only)", flush=True)
        tmp = path.with_name(path.name + ".partial")
        init_checkpoint(tmp, preset)
        os.replace(tmp, path)
    return path


def up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description="start a local pdserve cluster")
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the demo model)")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "base"],
                   help="demo model size when --model is not given")  # fmt: skip
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1,
                   help="decode workers (mixed unless --mode disaggregated)")  # fmt: skip
    p.add_argument("--mode", default="conditional", choices=MODES,
                   help="conditional: prefill + mixed workers, the scheduler choosing colocated "
                   "or disaggregated per request")  # fmt: skip
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="an existing Redis (default: $REDIS_URL, else embedded)")  # fmt: skip
    p.add_argument("--port", type=int, default=50051, help="router port (0: any free port)")
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temporary dir)")
    p.add_argument("--no-host-lease", dest="host_lease", action="store_false",
                   help="let the workers' engines run at once on this host's cores instead of "
                   "taking turns (decode steps first)")  # fmt: skip
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="extra worker flag, repeatable: --worker-arg=--dtype=float32")  # fmt: skip
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="send traces to this OTLP gRPC collector (Jaeger: http://localhost:4317)",
    )
    p.add_argument(
        "--trace-file",
        type=Path,
        metavar="PATH",
        help="append every span to this JSON-lines file (pdserve trace report)",
    )
    p.add_argument(
        "--metrics-base-port",
        type=int,
        default=0,
        metavar="PORT",
        help="/metrics ports PORT, PORT+1, ... in start order (default: free ports)",
    )
    return p


def main_up(argv: Sequence[str]) -> int:
    """``pdserve up``: start a cluster, print how to use it, stop it on Ctrl-C or SIGTERM."""
    args = up_parser().parse_args(list(argv))
    model = args.model if args.model is not None else default_model(args.preset)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = Cluster(
        model, num_prefill=args.prefill, num_decode=args.decode, mode=args.mode,
        redis_url=args.redis_url, router_port=args.port, log_dir=args.log_dir,
        worker_args=args.worker_arg, trace_file=args.trace_file,
        otlp_endpoint=args.otlp_endpoint, metrics_base_port=args.metrics_base_port,
        host_lease=args.host_lease,
    )  # fmt: skip
    print(f"starting pdserve ({args.mode}, model {model}) ...", flush=True)
    with cluster:
        address = cluster.router_address
        telemetry = describe_telemetry(cluster.metrics_urls(), cluster.child_env(), cluster.log_dir)
        print(
            f"\npdserve is up: router at {address} (redis {cluster.redis_url}, logs in "
            f"{cluster.log_dir})\n\ntry it:\n"
            f'  pdserve generate "Once upon a time" --router {address} --max-tokens 32\n'
            f"  pdserve status --redis-url {cluster.redis_url}\n\n"
            f"{telemetry}\n\n"
            "Ctrl-C stops everything.",
            flush=True,
        )
        while not stop.wait(1.0):  # also a liveness check of the children once a second
            dead = cluster.failed()
            if dead:
                for s in dead:
                    print(
                        f"pdserve up: {s.name} exited unexpectedly:\n{s.log_tail()}",
                        file=sys.stderr,
                    )
                return 1
        print("stopping ...", flush=True)
    return 0
