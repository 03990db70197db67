"""``ClusterSpec``: what a ``Cluster`` runs, checked when made (``InvalidArgumentError``
names the field), and the numbers that follow from it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.backends import BACKEND_NAMES, TORCH
from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.mooncake.address import parse_size
from pdserve.launcher.args import KV_STORES, MODES, kv_budget
from pdserve.supervisor import RestartPolicy


@dataclass
class ClusterSpec:
    """The settings of a ``Cluster``: its workers, services and their options.

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

    def kv_budget(self) -> int | None:
        """Each worker's ``--kv-cache-bytes`` (``kv_memory_fraction``, ``args.kv_budget``);
        None: the workers size their pools themselves."""
        return kv_budget(self.worker_args, self.backend, self.num_workers, self.kv_memory_fraction)
