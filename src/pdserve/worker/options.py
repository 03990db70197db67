"""Command-line options of the worker services (``services.prefill``, ``services.decode``).

Both services take the same flags, declared once here: each field of ``WorkerOptions`` is its
flag (``pdserve.settings``: name, help, default, parsing), from which ``worker_parser`` builds
the parser, ``options_from_args`` the options, and ``WorkerOptions.to_args`` a command line.
The options are checked when made (``__post_init__``): ``InvalidArgumentError`` names the flag.
Every flag defaults to an environment variable ``PDSERVE_<FIELD>`` (``--redis-url`` <-
``PDSERVE_REDIS_URL``; the ``--no-*`` hand-off switches and ``--fault`` aside); the services
pass ``os.environ`` in, the library itself reads no environment.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import settings
from pdserve.backends import BACKEND_NAMES, SIM, TENSORRT_LLM, TORCH
from pdserve.backends.tensorrt_llm_api import TRANSCEIVER_BACKENDS
from pdserve.compute.lease import BULK_TOKENS, INTERACTIVE_PERIOD_S
from pdserve.errors import InvalidArgumentError
from pdserve.handoff.plan import AUTO, TRANSPORT_CHOICES, TransferOptions
from pdserve.kvstore.backend import check_address
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.security.options import (
    INSECURE,
    SecurityOptions,
    add_security_args,
    security_from_args,
)
from pdserve.settings import required, setting
from pdserve.sim.flags import DEFAULT_LINK
from pdserve.transfer.base import TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.nixl.agent import nixl_api
from pdserve.worker.fault_specs import parse_faults
from pdserve.worker.scheduling_options import SchedulingOptions

CORES = "sharing the host's cores (see docs/serving.md)"
HANDOFF = "KV hand-off (see docs/kv-transfer.md)"
TRTLLM = "the tensorrt-llm backend (see docs/backends.md)"
SIM_GROUP = "the sim backend (see docs/simulation.md)"


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Everything a worker process is configured with; each field is its flag."""

    model: Path = required("checkpoint directory (required)")
    role: WorkerRole = required(choices=[r.value for r in WorkerRole])
    backend: str = setting(
        TORCH, "the engine: torch (pdserve's own, CPU or CUDA), tensorrt-llm (TensorRT-LLM's "
        "LLM API on a GPU; KV moves through its own transfer, transport native) or sim "
        "(pdserve's engine with modelled step times; see docs/simulation.md)",
        choices=BACKEND_NAMES,
    )  # fmt: skip
    host: str = setting("127.0.0.1", "address to bind (0.0.0.0 for all)")
    port: int = setting(0, "0 picks a free port")
    port_file: Path | None = setting(None, "bound port, once serving")
    advertise_host: str | None = setting(None, "host in heartbeats")
    """Defaults to ``host``, or ``host_name`` when binding all interfaces."""
    host_name: str = setting("", factory=socket.gethostname)
    """Host name in heartbeats (same-host transports)."""
    worker_id: str | None = setting(None)
    """Defaults to ``{role}-{host_name}-{port}``."""
    kvstore: str | None = setting(
        None, "KV store (prefill): host:port of pdserve's, or mooncake://MASTER[?...]",
        flags=("--kvstore", "--kv-store"),
    )  # fmt: skip
    """Required for role prefill (``kvstore.backend``)."""
    kv_lease_s: float = setting(60.0, to="transfer.lease_s")
    kv_timeout_s: float = setting(10.0)
    redis_url: str | None = setting(None, "heartbeats go here; unset: none")
    """None: no heartbeats (a worker used directly, without a scheduler)."""
    namespace: str = setting("pdserve", "Redis key prefix")
    heartbeat_interval_s: float = setting(1.0)
    max_wait_ms: float = setting(0.0, "prefill batching window when the engine is idle")
    """See ``AsyncEngine``; ``worker_parser`` gives each service its own default."""
    dtype: str = setting("auto", choices=["auto", "bfloat16", "float32"], to="engine")
    device: str = setting("cpu", to="engine")
    max_batch_tokens: int | None = setting(None, to="engine.max_num_batched_tokens")
    max_num_seqs: int | None = setting(None, to="engine")
    block_size: int | None = setting(None, to="engine")
    kv_blocks: int | None = setting(None, exclusive="kv", to="engine.num_kv_blocks")
    kv_cache_bytes: int | None = setting(None, exclusive="kv", to="engine")
    threads: int | None = setting(None, "torch CPU threads", to="engine.num_threads")
    host_lease: Path | None = setting(
        None, "directory shared by this host's workers: their engines take turns on the cores, "
        "decode steps first (default: none, the engine owns its cores)", group=CORES,
    )  # fmt: skip
    """``pdserve.compute.HostLease``; None: this engine has its cores to itself."""
    interactive_period_ms: float = setting(
        INTERACTIVE_PERIOD_S * 1000.0,
        "while a long prefill waits, start decode steps at most this often", group=CORES,
    )  # fmt: skip
    bulk_tokens: int = setting(
        BULK_TOKENS,
        "steps computing more prompt tokens than this lend the cores to decode steps", group=CORES,
    )  # fmt: skip
    lease_split_threads: int | None = setting(
        None, "threads decode steps keep while a long prefill runs beside them on the rest "
        "(default: half the engine's threads; 0: no split, the steps take turns)", group=CORES,
    )  # fmt: skip
    """``pdserve.compute.CoreSplit``; None: half the engine's threads; 0: no split."""
    grace_s: float = setting(10.0, "drain time")
    """On SIGTERM, how long in-flight requests may take to finish."""
    transport: str = setting(
        "auto", "prefill: force a transport; auto: shm on the decode worker's host, "
        "else --network-transport, or recompute when moving costs more",
        choices=TRANSPORT_CHOICES, group=HANDOFF, to="transfer",
    )  # fmt: skip
    network_transport: TransportKind = setting(
        TransportKind.DIRECT, choices=["direct", "store"], group=HANDOFF, to="transfer.network"
    )
    allow_shm: bool = setting(True, flags=("--no-shm",), group=HANDOFF, env=False, to="transfer")
    allow_recompute: bool = setting(
        True, flags=("--no-recompute",), group=HANDOFF, env=False, to="transfer"
    )
    kv_compression: Compression = setting(
        Compression.NONE, "int8 on the wire (store, direct)",
        choices=[c.value for c in Compression], group=HANDOFF, to="transfer.compression",
    )  # fmt: skip
    layerwise: bool = setting(
        True, "send the KV after the prefill instead of layer by layer during it",
        group=HANDOFF, env=False, to="transfer",
    )  # fmt: skip
    decode_prefix: bool = setting(
        True, "send the whole prompt's KV even when the decode worker caches a prefix of it",
        group=HANDOFF, env=False, to="transfer",
    )  # fmt: skip
    kv_prefetch: bool = setting(
        True, "do not announce layer-wise store/shm/nixl hand-offs to the decode worker as they "
        "begin (it then reads them only when the Decode call comes)", group=HANDOFF, env=False,
        to="transfer.prefetch",
    )  # fmt: skip
    kv_prefetch_min_bytes: int = setting(
        4 * 1024 * 1024, "announce only hand-offs of at least this many bytes (smaller ones "
        "are read faster than an announcement costs)", group=HANDOFF,
        to="transfer.prefetch_min_bytes",
    )  # fmt: skip
    kv_transfer_timeout_s: float = setting(
        0.0, "bound on a hand-off's commit and read; 0: from size and bandwidth", group=HANDOFF,
        to="transfer.timeout_s",
    )  # fmt: skip
    prefix_reuse: bool = setting(
        False, "prefill: share prompt-prefix KV chunks through the KV store", group=HANDOFF
    )
    prefix_chunk_tokens: int = setting(256, group=HANDOFF)
    prefix_lease_s: float = setting(600.0, group=HANDOFF)
    inbox_bytes: int = setting(
        2 * 1024**3, "decode: RAM budget of the inbox of pushed direct hand-offs", group=HANDOFF
    )
    shm_slot_bytes: int = setting(
        1024**3, "prefill: /dev/shm bytes of shm segments kept mapped and reused (at most a "
        "quarter of /dev/shm); 0: a fresh segment per hand-off", group=HANDOFF, to="transfer",
    )  # fmt: skip
    """``transfer.shm.slots``."""
    nixl_pool_bytes: int = setting(
        0, "nixl: KV block bytes registered with the NIXL agent at start (prefill; 0: 256 "
        "MiB with --transport nixl, else none), or landing blocks registered at the first "
        "nixl hand-off (decode; 0: 256 MiB)", group=HANDOFF, to="transfer",
    )  # fmt: skip
    nixl_block_bytes: int = setting(
        64 * 1024, "nixl: bytes of one registered block (a multiple of 4096)", group=HANDOFF,
        to="transfer",
    )  # fmt: skip
    janitor_interval_s: float = setting(60.0, group=HANDOFF)
    """How often orphaned shm segments are looked for (also once at start)."""
    janitor_max_age_s: float = setting(600.0, group=HANDOFF)
    """A sealed shm segment nobody read for this long is unlinked (its owner alive)."""
    faults: tuple[str, ...] = setting((), argparse.SUPPRESS, flags=("--fault",), env=False)
    """Fault injection for fault tests only, repeatable: corrupt[@PREFIX] or stall:N[@PREFIX]
    (hand-offs), nan[@PREFIX] or step[@PREFIX] (the engine); empty in production."""
    security: SecurityOptions = INSECURE
    """TLS, the internal credential and reflection (``pdserve.security``; its own flags)."""
    trtllm_transceiver: str = setting(
        "DEFAULT", "communication backend of TensorRT-LLM's cache transceiver (the KV transfer)",
        choices=TRANSCEIVER_BACKENDS, group=TRTLLM,
    )  # fmt: skip
    trtllm_kv_fraction: float | None = setting(
        None, "share of free GPU memory for TensorRT-LLM's KV cache (default: its own)",
        group=TRTLLM,
    )  # fmt: skip
    sim_profile: str = setting(
        "", "timing model: roofline:ACCEL:MODEL[:tpN] (ACCEL h100, a100; MODEL llama-3-8b, "
        "llama-3-70b, qwen2-7b or a config.json) or fitted:FILE (pdserve sim calibrate)",
        group=SIM_GROUP,
    )  # fmt: skip
    sim_time_scale: float = setting(
        1.0, "every modelled second lasts this many real ones (> 0)", group=SIM_GROUP
    )
    sim_link: str = setting(
        DEFAULT_LINK, "modelled link of hand-offs into this worker: nvlink, rdma-400, "
        "rdma-200, tcp-25, same-host", group=SIM_GROUP,
    )  # fmt: skip
    record_steps: Path | None = setting(
        None, "append every engine step's shape, threads and seconds to this JSON-lines file "
        "(torch backend), for 'pdserve sim calibrate --steps' to fit", group=SIM_GROUP,
    )  # fmt: skip
    """``sim.recording.StepLog``: the steps as this worker takes them, under its load."""
    scheduling: SchedulingOptions = field(default_factory=SchedulingOptions)
    """Lane, waiting order, KV events (``scheduling_options``)."""

    def __post_init__(self) -> None:
        """Refuse settings that cannot work together, naming the flag."""
        if self.model is None:  # --model unset (nor PDSERVE_MODEL)
            raise InvalidArgumentError("--model", "a checkpoint directory is required")
        if self.role is WorkerRole.PREFILL and not self.kvstore:
            raise InvalidArgumentError("--kvstore", "a prefill worker needs a KV store address")
        if self.kvstore:
            check_address(self.kvstore, "--kvstore")  # mooncake:// without its package: refused
        if self.kv_blocks is not None and self.kv_cache_bytes is not None:
            raise InvalidArgumentError(
                "--kv-blocks", "give --kv-blocks or --kv-cache-bytes, not both"
            )
        if not self.janitor_interval_s > 0:
            raise InvalidArgumentError("--janitor-interval-s", "must be > 0")
        if not self.interactive_period_ms >= 0:
            raise InvalidArgumentError("--interactive-period-ms", "must be >= 0")
        if self.bulk_tokens < 0:
            raise InvalidArgumentError("--bulk-tokens", "must be >= 0")
        if self.lease_split_threads is not None and self.lease_split_threads < 0:
            raise InvalidArgumentError("--lease-split-threads", "must be >= 0")
        settings.check_choices(self)
        parse_faults(self.faults)  # refuse a bad spec at start
        check_backend(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> WorkerOptions:
        """From ``worker_parser``'s flags; ``env``: where the internal token may come from
        (``PDSERVE_INTERNAL_TOKEN``)."""
        return settings.from_args(cls, args, security=security_from_args(args, env))

    def to_args(self) -> list[str]:
        """The flags that give these options (those of ``security`` aside): a worker's
        command line."""
        return settings.to_args(self)

    @property
    def reach_host(self) -> str:
        """The address other hosts reach this worker at (a Mooncake Store client's segment);
        empty when it binds every interface and advertises none (then: the route to the
        store)."""
        if self.advertise_host:
            return self.advertise_host
        return "" if self.host in ("0.0.0.0", "::", "") else self.host

    def transfer_options(self) -> TransferOptions:
        """The hand-off settings these options give (``setting(to="transfer...")``)."""
        return TransferOptions(
            **settings.fields_for(self, "transfer"), faults=parse_faults(self.faults)
        )

    def engine_config(self) -> dict[str, Any]:
        """The ``EngineConfig`` fields these options set (``setting(to="engine...")``)."""
        return settings.fields_for(self, "engine")

    def address(self, port: int) -> str:
        """host:port that other components use to reach this worker."""
        host = self.advertise_host or (
            self.host if self.host not in ("0.0.0.0", "::", "") else self.host_name
        )
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def identity_id(self, port: int) -> str:
        return self.worker_id or f"{self.role.value}-{self.host_name}-{port}"


def worker_parser(
    prog: str,
    description: str | None,
    *,
    roles: Sequence[WorkerRole],
    default_max_wait_ms: float,
    env: Mapping[str, str],
) -> argparse.ArgumentParser:
    """The flags of a worker service (``WorkerOptions``'s, the security flags and
    ``--log-level``); ``roles[0]`` is the default role."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    settings.add_flags(
        p, WorkerOptions, env,
        defaults={"role": roles[0].value, "max_wait_ms": default_max_wait_ms},
        choices={"role": [r.value for r in roles]},
    )  # fmt: skip
    p.add_argument("--log-level", default=env.get("PDSERVE_LOG_LEVEL", "INFO"))
    add_security_args(p, env)
    return p


def check_backend(o: WorkerOptions) -> None:
    """Refuse flags the chosen backend cannot honour, naming the flag."""
    if o.backend != SIM and o.sim_profile:
        raise InvalidArgumentError("--sim-profile", "needs --backend sim")
    if o.backend != TORCH and o.record_steps is not None:
        raise InvalidArgumentError("--record-steps", "records the torch engine's steps only")
    if o.transport == TransportKind.NIXL.value or o.nixl_pool_bytes:
        check_nixl(o)
    if o.backend in (TORCH, SIM):
        if o.transport == TransportKind.NATIVE.value:
            raise InvalidArgumentError("--transport", "native needs --backend tensorrt-llm")
        if o.backend == SIM:
            check_sim(o)
        return
    assert o.backend == TENSORRT_LLM  # check_choices came first
    if o.transport not in (AUTO, TransportKind.NATIVE.value, TransportKind.RECOMPUTE.value):
        raise InvalidArgumentError(
            "--transport",
            "the tensorrt-llm backend's KV moves only through its own transfer: auto, native "
            "or recompute",
        )
    if o.host_lease is not None:
        raise InvalidArgumentError(
            "--host-lease", "shares CPU cores between torch engines; tensorrt-llm runs on a GPU"
        )
    if o.prefix_reuse:
        raise InvalidArgumentError(
            "--prefix-reuse", "needs the torch backend: its KV leaves the engine as bytes"
        )
    fraction = o.trtllm_kv_fraction
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise InvalidArgumentError("--trtllm-kv-fraction", f"must be in (0, 1], got {fraction}")


def check_nixl(o: WorkerOptions) -> None:
    """``--transport nixl`` (or a NIXL pool, ``--nixl-pool-bytes``) needs NIXL (the
    ``pdserve[nixl]`` extra: never a silent fallback) and a backend whose KV leaves its engine
    as bytes through pdserve (the torch backend)."""
    if o.backend == SIM:
        raise InvalidArgumentError(
            "--transport",
            "nixl reads KV blocks an engine wrote; the sim backend models its hand-offs and "
            "writes none: use its modelled links (--sim-link) with another transport",
        )
    if o.backend != TORCH:
        return  # tensorrt-llm refuses it below, naming its own transports
    if o.nixl_block_bytes < 4096 or o.nixl_block_bytes % 4096:
        raise InvalidArgumentError("--nixl-block-bytes", "must be a multiple of 4096")
    if 0 < o.nixl_pool_bytes < o.nixl_block_bytes or o.nixl_pool_bytes < 0:
        raise InvalidArgumentError("--nixl-pool-bytes", "must hold at least one block")
    nixl_api("--transport")  # NixlUnavailableError names the extra


def check_sim(o: WorkerOptions) -> None:
    """A sim worker models exactly what its flags name, or refuses to start."""
    from pdserve.sim.backend import SimOptions  # imported only by sim workers

    if not o.sim_profile:
        raise InvalidArgumentError(
            "--sim-profile",
            "--backend sim needs a timing model: roofline:ACCEL:MODEL or fitted:FILE",
        )
    SimOptions.parse(o.sim_profile, o.sim_time_scale, o.sim_link)


def options_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> WorkerOptions:
    """``WorkerOptions.from_args``: ``InvalidArgumentError`` names a bad flag."""
    return WorkerOptions.from_args(args, env or {})
