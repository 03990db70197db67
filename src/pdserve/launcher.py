"""A whole pdserve cluster on one machine: what ``pdserve up`` (``pdserve.up``) and the tests run.

``Cluster.start()`` brings the services up in dependency order, each a child process on a free
port (``--port 0 --port-file F``)::

    Redis (embedded, unless a URL is given)
      -> KVStore, Scheduler
      -> N prefill + M decode workers (colocated: M mixed workers; conditional: N prefill +
         M mixed workers, the scheduler choosing per request), Router
      -> the HTTP gateway (when ``http_port`` is set)

and returns once every service's health check says SERVING (the gateway's ``/health``: 200)
and every worker's heartbeat is in Redis. ``stop()`` stops them in reverse order: SIGTERM, a
grace period, then SIGKILL. Children also get ``PR_SET_PDEATHSIG``, so none outlives a
launcher that is killed outright.

Security (``docs/security.md``): by default everything is plaintext and open on 127.0.0.1, the
insecure local mode. ``tls_dir`` runs the cluster secured with the certificates and internal
token of ``pdserve certs`` in that directory (made if missing): TLS on every port, mutual TLS
and the internal token between services, an embedded Redis with a password (its URL reaches
the services through ``PDSERVE_REDIS_URL``, never a command line), and the HTTP gateway
serves HTTPS with the cluster's certificate and calls the router over TLS; ``api_keys`` makes
the router demand API keys (the gateway forwards each HTTP caller's) and the scheduler apply
the tenants' quotas.

With ``supervise`` a ``supervisor.Supervisor`` restarts a service (or the embedded Redis) that
dies, on its port, while the rest serve on (``pdserve up`` supervises).

Telemetry: every service serves Prometheus ``/metrics`` on its own port (``metrics_urls()``;
free ports unless ``metrics_base_port`` is given) and traces into the OTLP collector at
``otlp_endpoint`` and/or the shared span file ``trace_file`` (``pdserve trace report
--span-file``); with neither, and no ``OTEL_*`` variables, nothing is traced.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import cast

from pdserve import hostmem
from pdserve.backends import BACKEND_NAMES, TORCH
from pdserve.engine.config import EngineConfig
from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.kvstore.mooncake.address import parse_size
from pdserve.kvstore.mooncake.master import MasterProcess
from pdserve.redis_server import EmbeddedRedis
from pdserve.scheduling import KeySpace, WorkerInfo
from pdserve.scheduling.keys import text
from pdserve.scheduling.redis_url import sync_client
from pdserve.security.certs import ClusterCerts, make_certs
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.security.tls import TlsConfig
from pdserve.service_process import HOST, ServiceProcess, terminate
from pdserve.supervisor import RestartPolicy, Supervisor
from pdserve.telemetry.tracing import ENV_OTLP_ENDPOINT, ENV_SERVICE_NAME, ENV_SPAN_FILE

DEFAULT_MODEL_ROOT = Path.home() / ".cache" / "pdserve" / "models"
MODES = ("disaggregated", "colocated", "conditional")
"""Cluster kinds: prefill + decode workers, mixed workers only, or prefill + mixed workers."""
KV_STORES = ("embedded", "mooncake")
"""The cluster's KV store: pdserve's KV store service, or a Mooncake Store whose
``mooncake_master`` the cluster starts (the workers lend it their segments)."""
_POLL_S = 0.05
"""Interval of readiness polls (port files, health, heartbeats): child processes offer nothing
to block on."""


def read_heartbeats(redis_url: str, namespace: str = "pdserve") -> list[WorkerInfo]:
    """Live worker heartbeats, read with a plain synchronous Redis client."""
    keys = KeySpace(namespace)
    client = sync_client(redis_url)
    try:
        ids = [text(i) for i in cast(list[bytes], client.zrange(keys.worker_index, 0, -1))]
        raws = client.mget([keys.worker(i) for i in ids]) if ids else []
    finally:
        client.close()
    return [WorkerInfo.from_json(raw) for raw in raws if raw is not None]


@dataclass
class Cluster:
    """Redis, KVStore (or a ``mooncake_master``), Scheduler, Router and workers as local child
    processes.

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
    num_schedulers: int = 1
    """Scheduler replicas (sharing Redis); every router places through all of them in turn."""
    num_routers: int = 1
    """Routers, each an entry point of its own (``router_addresses``)."""
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
    time, decode steps first) instead of oversubscribing them (torch backend only)."""
    kv_memory_fraction: float = 0.5
    """Of this host's available memory at start, the share the workers' KV pools take
    together, split evenly (``hostmem.kv_share``, at most the engine's default pool); a
    ``worker_args`` with ``--kv-blocks`` or ``--kv-cache-bytes`` sizes the pools itself."""
    backend: str = TORCH
    """The workers' engine (``--backend``): torch or tensorrt-llm."""
    http_port: int | None = None
    """The OpenAI-compatible HTTP gateway's port (0: a free one); None: no gateway."""
    gateway_args: Sequence[str] = ()
    """Extra flags for the gateway (``["--served-model-name", "demo"]``)."""
    tls_dir: Path | None = None
    """Run secured with the certificates and token of ``pdserve certs`` here (module doc)."""
    router_client_auth: bool = False
    """With ``tls_dir``: the router demands client certificates too (mutual TLS)."""
    api_keys: Path | None = None
    """The keys file of the router (API keys -> tenants) and scheduler (quotas)."""
    supervise: bool = False
    """Restart services that die (``supervisor``), once the cluster is up."""
    restart_policy: RestartPolicy | None = None
    announce: Callable[[str], None] | None = None
    """Hears the supervisor's exits, restarts and give-ups (default: the log)."""
    kv_store: str = "embedded"
    """``KV_STORES``: ``mooncake`` starts a ``mooncake_master`` (not supervised) in place of
    the KV store service; each worker lends it ``mooncake_segment`` of memory."""
    mooncake_segment: str = "256MiB"
    _mooncake: MasterProcess | None = field(default=None, init=False, repr=False)
    supervisor: Supervisor | None = field(default=None, init=False)
    services: list[ServiceProcess] = field(default_factory=list, init=False)
    metrics_ports: dict[str, int] = field(default_factory=dict, init=False)
    """Service name -> its bound ``/metrics`` port, once started."""
    _redis: EmbeddedRedis | None = field(default=None, init=False, repr=False)
    _certs: ClusterCerts | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)

    @property
    def lease_cores(self) -> bool:
        """Whether the workers take turns on the cores (a GPU engine has its own device)."""
        return self.host_lease and self.backend == TORCH

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if self.mode not in MODES:
            raise InvalidArgumentError("mode", f"must be one of {MODES}, got {self.mode!r}")
        if self.mode == "disaggregated" and self.num_prefill < 1:
            raise InvalidArgumentError("num_prefill", "disaggregated mode needs a prefill worker")
        if self.backend not in BACKEND_NAMES:
            raise InvalidArgumentError("backend", f"must be one of {BACKEND_NAMES}")
        if self.num_decode < 1:
            raise InvalidArgumentError("num_decode", "needs at least one decode (or mixed) worker")
        for name, count in (
            ("num_schedulers", self.num_schedulers),
            ("num_routers", self.num_routers),
        ):
            if count < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {count}")
        if not 0 <= self.metrics_base_port <= 65535:
            raise InvalidArgumentError(
                "metrics_base_port", f"must be in [0, 65535], got {self.metrics_base_port}"
            )
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise InvalidArgumentError(
                "http_port", f"must be in [0, 65535] or None, got {self.http_port}"
            )
        if self.trace_file is not None:
            self.trace_file = Path(self.trace_file)
        if self.kv_store not in KV_STORES:
            raise InvalidArgumentError("kv_store", f"must be one of {KV_STORES}")
        parse_size("mooncake_segment", self.mooncake_segment)
        if self.router_client_auth and self.tls_dir is None:
            raise InvalidArgumentError("router_client_auth", "needs tls_dir (certificates)")

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
    def router_addresses(self) -> list[str]:
        """Every router's address (``router_address`` is the first)."""
        return [self._service(replica_name("router", i)).address for i in range(self.num_routers)]

    @property
    def http_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the gateway (``https://`` in a secured cluster; the
        OpenAI base URL: add ``/v1``)."""
        scheme = "https" if self._certs is not None else "http"
        return f"{scheme}://{self._service('gateway').address}"

    @property
    def scheduler_address(self) -> str:
        return self._service("scheduler").address

    @property
    def scheduler_addresses(self) -> list[str]:
        """Every scheduler replica's address (``scheduler_address`` is the first)."""
        return [
            self._service(replica_name("scheduler", i)).address for i in range(self.num_schedulers)
        ]

    @property
    def kvstore_address(self) -> str:
        """The KV store's address: ``host:port`` of the service, or the ``mooncake://`` one."""
        if self._mooncake is not None:
            return self._mooncake.address(segment=self.mooncake_segment)
        return self._service("kvstore").address

    @property
    def mooncake_master(self) -> MasterProcess | None:
        """The cluster's ``mooncake_master`` (``kv_store="mooncake"``), once started."""
        return self._mooncake

    @property
    def embedded_redis(self) -> EmbeddedRedis | None:
        """The cluster's own Redis; None when it uses one at ``redis_url``."""
        return self._redis

    def metrics_urls(self) -> dict[str, str]:
        """Service name -> ``http://127.0.0.1:PORT/metrics``, in start order."""
        ports = self.metrics_ports
        return {
            s.name: f"http://{HOST}:{ports[s.name]}/metrics"
            for s in self.services
            if s.name in ports
        }

    @property
    def certs(self) -> ClusterCerts | None:
        """The certificates and token of a secured cluster (after ``start``)."""
        return self._certs

    @property
    def security(self) -> SecurityOptions:
        """How this process reaches the services (TLS with the cluster's certificate and CA,
        and the internal token): for health checks, and for tests that call services."""
        certs = self._certs
        if certs is None:
            return INSECURE
        tls = TlsConfig(cert=certs.node_cert, key=certs.node_key, ca=certs.ca)
        return SecurityOptions(tls=tls, internal_token=certs.token.read_text().strip())

    def _security_args(self, *, router: bool) -> list[str]:
        """Security flags of a service: the cluster's certificate, CA, mutual TLS (internal
        services; the router with ``router_client_auth``) and the token file."""
        certs = self._certs
        if certs is None:
            return []
        args = ["--tls-cert", str(certs.node_cert), "--tls-key", str(certs.node_key),
                "--tls-ca", str(certs.ca), "--internal-token-file", str(certs.token)]  # fmt: skip
        if not router or self.router_client_auth:
            args.append("--tls-client-auth")
        return args

    def _gateway_security_args(self) -> list[str]:
        """HTTPS with the cluster's certificate, TLS to the router, and the client
        certificate (not a member's) when the router demands one. No internal token: the
        gateway is a client, which sends each HTTP caller's API key."""
        certs = self._certs
        if certs is None:
            return []
        args = ["--tls-cert", str(certs.node_cert), "--tls-key", str(certs.node_key),
                "--router-tls-ca", str(certs.ca)]  # fmt: skip
        if self.router_client_auth:
            args += ["--router-tls-cert", str(certs.client_cert),
                     "--router-tls-key", str(certs.client_key)]  # fmt: skip
        return args

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
        if self.redis_url is not None:  # a password stays off the command lines
            env["PDSERVE_REDIS_URL"] = self.redis_url
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
        if self.supervise:
            self.supervisor = Supervisor(
                self.services,
                self.child_env(),
                redis=self._redis,
                policy=self.restart_policy,
                announce=self.announce,
            )
            self.supervisor.start()
        return self

    @property
    def num_workers(self) -> int:
        """Workers ``start`` runs: prefill ones (none when colocated) and decode or mixed ones."""
        return (0 if self.mode == "colocated" else self.num_prefill) + self.num_decode

    @property
    def num_services(self) -> int:
        """Services ``start`` runs (the embedded Redis aside): what a fixed
        ``metrics_base_port`` needs consecutive free ports for. ``_start`` checks it."""
        workers = self.num_workers
        gateway = self.http_port is not None
        kvstore = int(self.kv_store == "embedded")
        return (
            kvstore + self.num_schedulers + workers + int(self.planner) + self.num_routers + gateway
        )

    def _start(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        if self.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-cluster-")
            self.log_dir = Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.tls_dir is not None:
            self._certs = make_certs(Path(self.tls_dir))
        if self.redis_url is None:
            password = secrets.token_hex(16) if self._certs is not None else None
            self._redis = EmbeddedRedis(password=password).start()
            self.redis_url = self._redis.url
        env = self.child_env()  # the Redis URL goes in PDSERVE_REDIS_URL
        common = ["--log-level", self.log_level]
        internal = [*common, *self._security_args(router=False)]
        keys = ["--api-keys", str(self.api_keys)] if self.api_keys is not None else []

        first: list[ServiceProcess] = []
        if self.kv_store == "mooncake":  # refused here without the package, naming its extra
            self._mooncake = MasterProcess().start()
        else:
            first.append(self._add("kvstore", "services.kvstore", internal))
        schedulers = [
            self._add(
                replica_name("scheduler", i),
                "services.scheduler",
                [
                    *internal,
                    "--namespace",
                    self.namespace,
                    "--default-mode",
                    self.mode,
                    *keys,
                    *self.scheduler_args,
                ],
            )
            for i in range(self.num_schedulers)
        ]
        for s in (*first, *schedulers):
            s.spawn(env)
        self._wait("port files", [*first, *schedulers], self._read_ports, deadline)

        worker_common = [
            *internal, "--model", str(self.model_dir),
            "--namespace", self.namespace, "--kvstore", self.kvstore_address,
            "--backend", self.backend,
            *(["--host-lease", str(self.log_dir / "host-lease")] if self.lease_cores else []),
            *self._kv_budget_args(),
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
                [*common, "--namespace", self.namespace, *self.planner_args],
            ))  # fmt: skip
        replicas = ",".join(s.address for s in schedulers)
        routers = [
            self._add(
                replica_name("router", i),
                "services.router",
                [
                    *common,
                    *self._security_args(router=True),
                    "--scheduler",
                    replicas,
                    "--model",
                    str(self.model_dir),
                    "--mode",
                    self.mode,
                    "--namespace",
                    self.namespace,
                    *keys,
                    *self.router_args,
                ],
            )
            for i in range(self.num_routers)
        ]
        router = routers[0]
        if self.router_port:
            router.args += ["--port", str(self.router_port)]  # the last --port wins
        for s in [*late, *routers]:
            s.spawn(env)
        self._wait("port files", [*late, *routers], self._read_ports, deadline)
        if self.http_port is not None:
            gateway = self._add(
                "gateway", "services.gateway",
                [*common, *self._gateway_security_args(), "--router", router.address,
                 "--model", str(self.model_dir), *self.gateway_args],
                http=True,
            )  # fmt: skip
            # The port goes to spawn, not into the args: a restart passes the port the first
            # run bound, and an argument "--port 0" would override it with a new one.
            gateway.spawn(env, port=self.http_port)
            self._wait("port files", [gateway], self._read_ports, deadline)
        assert len(self.services) == self.num_services, "num_services disagrees with _start"
        security = self.security
        self._wait("health checks", self.services, lambda s: s.is_healthy(security), deadline)
        self._wait_heartbeats(deadline)

    def _kv_budget_args(self) -> list[str]:
        """``--kv-cache-bytes`` of each worker's share (``kv_memory_fraction``), unless the
        worker args size the pool, the backend is not ours, or memory is unknown."""
        sized = any(
            a.split("=")[0] in ("--kv-blocks", "--kv-cache-bytes") for a in self.worker_args
        )
        available = hostmem.available_bytes()
        if sized or self.backend != TORCH or available is None:
            return []
        workers = self.num_workers
        share = hostmem.kv_share(
            available, workers, self.kv_memory_fraction, EngineConfig().kv_cache_bytes
        )
        return ["--kv-cache-bytes", str(share)]

    def _add(
        self, name: str, module: str, args: list[str], role: str | None = None, http: bool = False
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
            http=http,
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
        """Stop every service, gateway and router first, Redis last. Idempotent.

        A temporary log dir is deleted unless ``keep_logs``."""
        if self.supervisor is not None:
            self.supervisor.halt()  # no restart may race the shutdown
        tiers = [
            [s for s in self.services if s.name == "gateway"],
            [s for s in self.services if s.name == "planner" or is_replica(s.name, "router")],
            self.workers(),
            [s for s in self.services if s.name == "kvstore" or is_replica(s.name, "scheduler")],
        ]
        for tier in tiers:
            terminate([s.proc for s in tier if s.proc is not None], self.stop_grace_s)
        self.services.clear()
        self.metrics_ports.clear()
        if self._mooncake is not None:
            self._mooncake.stop()
            self._mooncake = None
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
            self.redis_url = None
        if self.supervisor is not None:
            self.supervisor.finish()  # its restarted children are stopped: its thread may end
            self.supervisor = None
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


# -- the demo checkpoint (pdserve up, benchmarks) --------------------------------------------------


def replica_name(service: str, i: int) -> str:
    """The name of replica ``i`` of a service: the first keeps the plain name."""
    return service if i == 0 else f"{service}-{i}"


def is_replica(name: str, service: str) -> bool:
    """Whether ``name`` is one of ``service``'s replicas (``replica_name``)."""
    return name == service or (
        name.startswith(f"{service}-") and name.removeprefix(f"{service}-").isdigit()
    )


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
