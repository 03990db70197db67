"""``Cluster``: the lifecycle and addresses of the services its settings (``ClusterSpec``)
name; ``args`` builds their command lines, ``readiness`` waits for them (package doc)."""

from __future__ import annotations

import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.compute.omp import worker_omp_env
from pdserve.errors import WorkerUnavailableError
from pdserve.kvstore.mooncake.master import MasterProcess
from pdserve.launcher import args as cmd
from pdserve.launcher.args import is_replica, replica_name
from pdserve.launcher.readiness import beating, wait_for
from pdserve.launcher.spec import ClusterSpec
from pdserve.redis_server import EmbeddedRedis
from pdserve.security.certs import ClusterCerts, make_certs
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.security.tls import TlsConfig
from pdserve.service_process import HOST, ServiceProcess, terminate
from pdserve.supervisor import Supervisor
from pdserve.telemetry.tracing import ENV_OTLP_ENDPOINT, ENV_SERVICE_NAME, ENV_SPAN_FILE


@dataclass
class Cluster(ClusterSpec):
    """Redis, KVStore (or a ``mooncake_master``), Scheduler, Router and workers as local child
    processes, as its settings (``ClusterSpec``) say.

    ``with Cluster(model_dir, num_prefill=2, num_decode=2) as c: Client(c.router_address)``.
    """

    _mooncake: MasterProcess | None = field(default=None, init=False, repr=False)
    supervisor: Supervisor | None = field(default=None, init=False)
    services: list[ServiceProcess] = field(default_factory=list, init=False)
    metrics_ports: dict[str, int] = field(default_factory=dict, init=False)
    """Service name -> its bound ``/metrics`` port, once started."""
    _redis: EmbeddedRedis | None = field(default=None, init=False, repr=False)
    _certs: ClusterCerts | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)

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

    def child_env(self) -> dict[str, str]:
        """The environment every service starts with."""
        # Idle OpenMP threads sleep (compute.omp), unless the caller chose otherwise.
        env = {**worker_omp_env(), **self.env, "PYTHONUNBUFFERED": "1"}
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
        internal = [*common, *cmd.security_args(self._certs, client_auth=True)]
        keys = ["--api-keys", str(self.api_keys)] if self.api_keys is not None else []
        scheduler = ["--namespace", self.namespace, "--default-mode", self.mode, *keys,
                     *self.scheduler_args]  # fmt: skip

        first: list[ServiceProcess] = []
        if self.kv_store == "mooncake":  # refused here without the package, naming its extra
            self._mooncake = MasterProcess().start()
        else:
            first.append(self._add("kvstore", "services.kvstore", internal))
        schedulers = [
            self._add(replica_name("scheduler", i), "services.scheduler", [*internal, *scheduler])
            for i in range(self.num_schedulers)
        ]
        for s in (*first, *schedulers):
            s.spawn(env)
        wait_for("port files", [*first, *schedulers], self._read_ports, deadline, self.log_dir)

        worker_common = [
            *internal,
            *cmd.worker_args(
                self.model_dir, self.namespace, self.kvstore_address, self.backend,
                host_lease=self.log_dir / "host-lease" if self.lease_cores else None,
                kv_cache_bytes=self.kv_budget(), extra=self.worker_args,
            ),
        ]  # fmt: skip
        late = [
            self._add(
                f"{role}-{i}",
                f"services.{'decode' if role == 'mixed' else role}",
                [*worker_common, *cmd.role_args(role, i, self.lanes, self.duties)],
                role=role,
            )
            for role, i in cmd.worker_roles(self.mode, self.num_prefill, self.num_decode)
        ]
        if self.planner:
            late.append(self._add(
                "planner", "services.planner",
                [*common, "--namespace", self.namespace, *self.planner_args],
            ))  # fmt: skip
        router_args = [
            *common, *cmd.security_args(self._certs, client_auth=self.router_client_auth),
            "--scheduler", ",".join(s.address for s in schedulers), "--model", str(self.model_dir),
            "--mode", self.mode, "--namespace", self.namespace, *keys, *self.router_args,
        ]  # fmt: skip
        routers = [
            self._add(replica_name("router", i), "services.router", router_args)
            for i in range(self.num_routers)
        ]
        router = routers[0]
        if self.router_port:
            router.args += ["--port", str(self.router_port)]  # the last --port wins
        for s in [*late, *routers]:
            s.spawn(env)
        wait_for("port files", [*late, *routers], self._read_ports, deadline, self.log_dir)
        if self.http_port is not None:
            gateway = self._add(
                "gateway", "services.gateway",
                [*common, *cmd.gateway_security_args(self._certs, self.router_client_auth),
                 "--router", router.address, "--model", str(self.model_dir), *self.gateway_args],
                http=True,
            )  # fmt: skip
            # The port goes to spawn, not into the args: a restart passes the port the first
            # run bound, and an argument "--port 0" would override it with a new one.
            gateway.spawn(env, port=self.http_port)
            wait_for("port files", [gateway], self._read_ports, deadline, self.log_dir)
        assert len(self.services) == self.num_services, "num_services disagrees with _start"
        security = self.security
        wait_for(
            "health checks", self.services, lambda s: s.is_healthy(security), deadline, self.log_dir
        )
        assert self.redis_url is not None
        heartbeats = beating(self.redis_url, self.namespace)
        wait_for("heartbeats", self.workers(), heartbeats, deadline, self.log_dir)

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

    def __exit__(self, *exc: object) -> None:
        self.stop()
