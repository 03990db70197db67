"""Command-line options of the worker services (``services.prefill``, ``services.decode``).

Both services take the same flags, so they are declared once here. Every flag defaults to an
environment variable ``PDSERVE_<FLAG>`` (``--redis-url`` <- ``PDSERVE_REDIS_URL``); the
services pass ``os.environ`` in, the library itself reads no environment.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.backends import BACKEND_NAMES, SIM, TENSORRT_LLM, TORCH
from pdserve.backends.tensorrt_llm_api import TRANSCEIVER_BACKENDS
from pdserve.compute.lease import BULK_TOKENS, INTERACTIVE_PERIOD_S
from pdserve.errors import InvalidArgumentError
from pdserve.handoff.plan import AUTO, TRANSPORT_CHOICES, TransferOptions
from pdserve.kvstore.backend import check_address
from pdserve.scheduling import WorkerRole
from pdserve.security.options import (
    INSECURE,
    SecurityOptions,
    add_security_args,
    security_from_args,
)
from pdserve.sim.flags import DEFAULT_LINK
from pdserve.transfer.base import TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.nixl.agent import nixl_api
from pdserve.worker.fault_specs import parse_faults
from pdserve.worker.scheduling_options import (
    SchedulingOptions,
    add_scheduling_args,
    scheduling_options,
)

ENV_PREFIX = "PDSERVE_"


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Everything a worker process is configured with."""

    model: Path
    role: WorkerRole
    backend: str = TORCH
    """The engine: ``torch`` (pdserve's own), ``tensorrt-llm`` or ``sim`` (pdserve's engine
    with modelled step times, ``pdserve.sim``)."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 0
    port_file: Path | None = None
    advertise_host: str | None = None
    """Host part of the address in heartbeats; defaults to ``host``, or ``host_name`` when
    binding all interfaces."""
    host_name: str = ""
    """Host name in heartbeats (same-host transports); defaults to this machine's name."""
    worker_id: str | None = None
    """Defaults to ``{role}-{host_name}-{port}``."""
    kvstore: str | None = None
    """The KV store prefills write to (required for role prefill): pdserve's KV store service
    at ``host:port``, or a Mooncake Store at ``mooncake://MASTER[?...]`` (``kvstore.backend``)."""
    kv_lease_s: float = 60.0
    kv_timeout_s: float = 10.0
    redis_url: str | None = None
    """None: no heartbeats (a worker used directly, without a scheduler)."""
    namespace: str = "pdserve"
    heartbeat_interval_s: float = 1.0
    max_wait_ms: float = 0.0
    """Prefill batching window (see ``AsyncEngine``)."""
    dtype: str = "auto"
    device: str = "cpu"
    max_batch_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    threads: int | None = None
    host_lease: Path | None = None
    """Directory shared by the workers of one host whose engines take turns on its cores
    (``pdserve.compute.HostLease``); None: this engine has its cores to itself."""
    interactive_period_ms: float = INTERACTIVE_PERIOD_S * 1000.0
    """With a host lease: while bulk work waits, interactive steps start at most this often."""
    bulk_tokens: int = BULK_TOKENS
    """With a host lease: a step computing more prompt tokens than this is bulk."""
    lease_split_threads: int | None = None
    """With a host lease: threads interactive steps keep while a bulk step runs beside them
    on the rest (``pdserve.compute.CoreSplit``); None: half the engine's; 0: no split, the
    steps take turns on every thread."""
    grace_s: float = 10.0
    """On SIGTERM, how long in-flight requests may take to finish."""
    transport: str = "auto"
    """KV transport of this prefill worker's hand-offs (``auto``: the policy chooses)."""
    network_transport: str = "direct"
    """What a cross-host hand-off uses when the decode worker is known: direct or store."""
    allow_shm: bool = True
    allow_recompute: bool = True
    kv_compression: str = "none"
    layerwise: bool = True
    decode_prefix: bool = True
    """Send only the KV blocks the decode worker's prefix cache lacks (``decode_prefix``)."""
    kv_prefetch: bool = True
    """Announce layer-wise store/shm hand-offs to the decode worker as they begin."""
    kv_prefetch_min_bytes: int = 4 * 1024 * 1024
    """Hand-offs smaller than this are not announced (read after the fact)."""
    kv_transfer_timeout_s: float = 0.0
    """Bound on a hand-off's commit and read; 0: from payload size and measured bandwidth."""
    prefix_reuse: bool = False
    """Fetch prompt-prefix KV chunks from the KV store, and publish new ones there."""
    prefix_chunk_tokens: int = 256
    prefix_lease_s: float = 600.0
    inbox_bytes: int = 2 * 1024**3
    """RAM budget of a decode worker's inbox (the direct hand-offs pushed into it)."""
    shm_slot_bytes: int = 1024**3
    """prefill: ``/dev/shm`` bytes of reused shm segments kept mapped (``transfer.shm.slots``);
    0: a fresh segment per hand-off."""
    nixl_pool_bytes: int = 0
    """prefill: KV block bytes registered with the NIXL agent at start (0: 256 MiB with
    ``--transport nixl``, else none); decode: its landing blocks, registered at its first nixl
    hand-off (0: 256 MiB)."""
    nixl_block_bytes: int = 64 * 1024
    janitor_interval_s: float = 60.0
    """How often orphaned shm segments are looked for (also once at start)."""
    janitor_max_age_s: float = 600.0
    """A sealed shm segment nobody read for this long is unlinked (its owner alive)."""
    faults: tuple[str, ...] = ()
    """Fault injection for fault tests (``--fault``); empty in production."""
    security: SecurityOptions = INSECURE
    """TLS, the internal credential and reflection (``pdserve.security``)."""
    trtllm_transceiver: str = "DEFAULT"
    """tensorrt-llm: the cache transceiver's communication backend (its KV transfer)."""
    trtllm_kv_fraction: float | None = None
    """tensorrt-llm: the share of free GPU memory its KV cache takes (None: its default)."""
    scheduling: SchedulingOptions = field(default_factory=SchedulingOptions)
    """Lane, waiting order, KV events (``scheduling_options``)."""
    sim_profile: str = ""
    """sim: the timing model (``roofline:ACCEL:MODEL[:tpN]`` or ``fitted:FILE``)."""
    sim_time_scale: float = 1.0
    """sim: every modelled second lasts this many real ones."""
    sim_link: str = DEFAULT_LINK
    """sim: the modelled link a hand-off's KV crosses to reach this worker."""

    @property
    def reach_host(self) -> str:
        """The address other hosts reach this worker at (a Mooncake Store client's segment);
        empty when it binds every interface and advertises none (then: the route to the
        store)."""
        if self.advertise_host:
            return self.advertise_host
        return "" if self.host in ("0.0.0.0", "::", "") else self.host

    def transfer_options(self) -> TransferOptions:
        """The hand-off settings these options give."""
        return TransferOptions(
            transport=self.transport,
            network=TransportKind(self.network_transport),
            allow_shm=self.allow_shm,
            allow_recompute=self.allow_recompute,
            compression=Compression(self.kv_compression),
            layerwise=self.layerwise,
            decode_prefix=self.decode_prefix,
            prefetch=self.kv_prefetch,
            prefetch_min_bytes=self.kv_prefetch_min_bytes,
            timeout_s=self.kv_transfer_timeout_s,
            lease_s=self.kv_lease_s,
            shm_slot_bytes=self.shm_slot_bytes,
            nixl_pool_bytes=self.nixl_pool_bytes,
            nixl_block_bytes=self.nixl_block_bytes,
            faults=parse_faults(self.faults),
        )

    def engine_config(self) -> dict[str, Any]:
        """The ``EngineConfig`` fields these options set."""
        fields = {
            "dtype": self.dtype,
            "device": self.device,
            "max_num_batched_tokens": self.max_batch_tokens,
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "num_kv_blocks": self.kv_blocks,
            "kv_cache_bytes": self.kv_cache_bytes,
            "num_threads": self.threads,
        }
        return {
            **{k: v for k, v in fields.items() if v is not None},
            **self.scheduling.engine_config(),
        }

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
    """The flags of a worker service; ``roles[0]`` is the default role."""

    def d(flag: str, default: Any = None) -> Any:
        return env.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model", type=Path, default=d("model"), help="checkpoint directory (required)")
    p.add_argument(
        "--backend", choices=BACKEND_NAMES, default=d("backend", TORCH),
        help="the engine: torch (pdserve's own, CPU or CUDA), tensorrt-llm (TensorRT-LLM's "
        "LLM API on a GPU; KV moves through its own transfer, transport native) or sim "
        "(pdserve's engine with modelled step times; see docs/simulation.md)",
    )  # fmt: skip
    p.add_argument("--role", choices=[r.value for r in roles], default=d("role", roles[0].value))
    p.add_argument(
        "--host", default=d("host", "127.0.0.1"), help="address to bind (0.0.0.0 for all)"
    )
    p.add_argument("--port", type=int, default=int(d("port", 0)), help="0 picks a free port")
    p.add_argument(
        "--port-file", type=Path, default=d("port_file"), help="bound port, once serving"
    )
    p.add_argument("--advertise-host", default=d("advertise_host"), help="host in heartbeats")
    p.add_argument("--host-name", default=d("host_name", socket.gethostname()))
    p.add_argument("--worker-id", default=d("worker_id"))
    p.add_argument(
        "--kvstore",
        "--kv-store",
        dest="kvstore",
        default=d("kvstore"),
        help="KV store (prefill): host:port of pdserve's, or mooncake://MASTER[?...]",
    )
    p.add_argument("--kv-lease-s", type=float, default=float(d("kv_lease_s", 60.0)))
    p.add_argument("--kv-timeout-s", type=float, default=float(d("kv_timeout_s", 10.0)))
    p.add_argument("--redis-url", default=d("redis_url"), help="heartbeats go here; unset: none")
    p.add_argument("--namespace", default=d("namespace", "pdserve"), help="Redis key prefix")
    p.add_argument(
        "--heartbeat-interval-s", type=float, default=float(d("heartbeat_interval_s", 1.0))
    )
    p.add_argument(
        "--max-wait-ms", type=float, default=float(d("max_wait_ms", default_max_wait_ms)),
        help="prefill batching window when the engine is idle",
    )  # fmt: skip
    p.add_argument("--dtype", default=d("dtype", "auto"), choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default=d("device", "cpu"))
    p.add_argument("--max-batch-tokens", type=int, default=_int(d("max_batch_tokens")))
    p.add_argument("--max-num-seqs", type=int, default=_int(d("max_num_seqs")))
    p.add_argument("--block-size", type=int, default=_int(d("block_size")))
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, default=_int(d("kv_blocks")))
    kv.add_argument("--kv-cache-bytes", type=int, default=_int(d("kv_cache_bytes")))
    p.add_argument("--threads", type=int, default=_int(d("threads")), help="torch CPU threads")
    c = p.add_argument_group("sharing the host's cores (see docs/serving.md)")
    c.add_argument(
        "--host-lease",
        type=Path,
        default=d("host_lease"),
        help="directory shared by this host's workers: their engines take turns on the cores, "
        "decode steps first (default: none, the engine owns its cores)",
    )
    c.add_argument(
        "--interactive-period-ms",
        type=float,
        default=float(d("interactive_period_ms", INTERACTIVE_PERIOD_S * 1000.0)),
        help="while a long prefill waits, start decode steps at most this often",
    )
    c.add_argument(
        "--bulk-tokens",
        type=int,
        default=int(d("bulk_tokens", BULK_TOKENS)),
        help="steps computing more prompt tokens than this lend the cores to decode steps",
    )
    c.add_argument(
        "--lease-split-threads",
        type=int,
        default=_int(d("lease_split_threads")),
        help="threads decode steps keep while a long prefill runs beside them on the rest "
        "(default: half the engine's threads; 0: no split, the steps take turns)",
    )
    p.add_argument("--grace-s", type=float, default=float(d("grace_s", 10.0)), help="drain time")
    p.add_argument("--log-level", default=d("log_level", "INFO"))
    t = p.add_argument_group("KV hand-off (see docs/kv-transfer.md)")
    t.add_argument(
        "--transport",
        choices=TRANSPORT_CHOICES,
        default=d("transport", "auto"),
        help="prefill: force a transport; auto: shm on the decode worker's host, "
        "else --network-transport, or recompute when moving costs more",
    )
    t.add_argument(
        "--network-transport", choices=["direct", "store"], default=d("network_transport", "direct")
    )
    t.add_argument("--no-shm", dest="allow_shm", action="store_false", default=True)
    t.add_argument("--no-recompute", dest="allow_recompute", action="store_false", default=True)
    t.add_argument(
        "--kv-compression",
        choices=[c.value for c in Compression],
        default=d("kv_compression", "none"),
        help="int8 on the wire (store, direct)",
    )
    t.add_argument(
        "--no-layerwise",
        dest="layerwise",
        action="store_false",
        default=True,
        help="send the KV after the prefill instead of layer by layer during it",
    )
    t.add_argument(
        "--no-decode-prefix",
        dest="decode_prefix",
        action="store_false",
        default=True,
        help="send the whole prompt's KV even when the decode worker caches a prefix of it",
    )
    t.add_argument(
        "--no-kv-prefetch",
        dest="kv_prefetch",
        action="store_false",
        default=True,
        help="do not announce layer-wise store/shm hand-offs to the decode worker as they "
        "begin (it then reads them only when the Decode call comes)",
    )
    t.add_argument(
        "--kv-prefetch-min-bytes",
        type=int,
        default=int(d("kv_prefetch_min_bytes", 4 * 1024 * 1024)),
        help="announce only hand-offs of at least this many bytes (smaller ones are read "
        "faster than an announcement costs)",
    )
    t.add_argument(
        "--kv-transfer-timeout-s",
        type=float,
        default=float(d("kv_transfer_timeout_s", 0.0)),
        help="bound on a hand-off's commit and read; 0: from size and bandwidth",
    )
    t.add_argument(
        "--prefix-reuse",
        action="store_true",
        default=d("prefix_reuse", "") == "1",
        help="prefill: share prompt-prefix KV chunks through the KV store",
    )
    t.add_argument("--prefix-chunk-tokens", type=int, default=int(d("prefix_chunk_tokens", 256)))
    t.add_argument("--prefix-lease-s", type=float, default=float(d("prefix_lease_s", 600.0)))
    t.add_argument(
        "--inbox-bytes",
        type=int,
        default=int(d("inbox_bytes", 2 * 1024**3)),
        help="decode: RAM budget of the inbox of pushed direct hand-offs",
    )
    t.add_argument(
        "--shm-slot-bytes",
        type=int,
        default=int(d("shm_slot_bytes", 1024**3)),
        help="prefill: /dev/shm bytes of shm segments kept mapped and reused (at most a "
        "quarter of /dev/shm); 0: a fresh segment per hand-off",
    )
    t.add_argument(
        "--nixl-pool-bytes",
        type=int,
        default=int(d("nixl_pool_bytes", 0)),
        help="nixl: KV block bytes registered with the NIXL agent at start (prefill; 0: 256 "
        "MiB with --transport nixl, else none), or landing blocks registered at the first "
        "nixl hand-off (decode; 0: 256 MiB)",
    )
    t.add_argument(
        "--nixl-block-bytes",
        type=int,
        default=int(d("nixl_block_bytes", 64 * 1024)),
        help="nixl: bytes of one registered block (a multiple of 4096)",
    )
    t.add_argument("--janitor-interval-s", type=float, default=float(d("janitor_interval_s", 60.0)))
    t.add_argument("--janitor-max-age-s", type=float, default=float(d("janitor_max_age_s", 600.0)))
    g = p.add_argument_group("the tensorrt-llm backend (see docs/backends.md)")
    g.add_argument(
        "--trtllm-transceiver", choices=TRANSCEIVER_BACKENDS,
        default=d("trtllm_transceiver", "DEFAULT"),
        help="communication backend of TensorRT-LLM's cache transceiver (the KV transfer)",
    )  # fmt: skip
    g.add_argument(
        "--trtllm-kv-fraction", type=float, default=_float(d("trtllm_kv_fraction")),
        help="share of free GPU memory for TensorRT-LLM's KV cache (default: its own)",
    )  # fmt: skip
    m = p.add_argument_group("the sim backend (see docs/simulation.md)")
    m.add_argument(
        "--sim-profile", default=d("sim_profile", ""),
        help="timing model: roofline:ACCEL:MODEL[:tpN] (ACCEL h100, a100; MODEL llama-3-8b, "
        "llama-3-70b, qwen2-7b or a config.json) or fitted:FILE (pdserve sim calibrate)",
    )  # fmt: skip
    m.add_argument(
        "--sim-time-scale", type=float, default=float(d("sim_time_scale", 1.0)),
        help="every modelled second lasts this many real ones (> 0)",
    )  # fmt: skip
    m.add_argument(
        "--sim-link", default=d("sim_link", DEFAULT_LINK),
        help="modelled link of hand-offs into this worker: nvlink, rdma-400, rdma-200, "
        "tcp-25, same-host",
    )  # fmt: skip
    # Fault injection, for fault tests only, repeatable: corrupt[@PREFIX] or stall:N[@PREFIX]
    # (hand-offs), nan[@PREFIX] or step[@PREFIX] (the engine).
    t.add_argument("--fault", action="append", default=[], help=argparse.SUPPRESS)
    add_security_args(p, env)
    add_scheduling_args(p, d)
    return p


def _int(value: str | None) -> int | None:
    return None if value is None else int(value)


def _float(value: str | None) -> float | None:
    return None if value is None else float(value)


def check_backend(args: argparse.Namespace) -> None:
    """Refuse flags the chosen backend cannot honour, naming the flag."""
    if args.backend != SIM and args.sim_profile:
        raise InvalidArgumentError("--sim-profile", "needs --backend sim")
    if args.transport == TransportKind.NIXL.value or args.nixl_pool_bytes:
        check_nixl(args)
    if args.backend in (TORCH, SIM):
        if args.transport == TransportKind.NATIVE.value:
            raise InvalidArgumentError("--transport", "native needs --backend tensorrt-llm")
        if args.backend == SIM:
            check_sim(args)
        return
    assert args.backend == TENSORRT_LLM
    if args.transport not in (AUTO, TransportKind.NATIVE.value, TransportKind.RECOMPUTE.value):
        raise InvalidArgumentError(
            "--transport",
            "the tensorrt-llm backend's KV moves only through its own transfer: auto, native "
            "or recompute",
        )
    if args.host_lease is not None:
        raise InvalidArgumentError(
            "--host-lease", "shares CPU cores between torch engines; tensorrt-llm runs on a GPU"
        )
    if args.prefix_reuse:
        raise InvalidArgumentError(
            "--prefix-reuse", "needs the torch backend: its KV leaves the engine as bytes"
        )
    fraction = args.trtllm_kv_fraction
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise InvalidArgumentError("--trtllm-kv-fraction", f"must be in (0, 1], got {fraction}")


def check_nixl(args: argparse.Namespace) -> None:
    """``--transport nixl`` (or a NIXL pool, ``--nixl-pool-bytes``) needs NIXL (the
    ``pdserve[nixl]`` extra: never a silent fallback) and a backend whose KV leaves its engine
    as bytes through pdserve (the torch backend)."""
    if args.backend == SIM:
        raise InvalidArgumentError(
            "--transport",
            "nixl reads KV blocks an engine wrote; the sim backend models its hand-offs and "
            "writes none: use its modelled links (--sim-link) with another transport",
        )
    if args.backend != TORCH:
        return  # tensorrt-llm refuses it below, naming its own transports
    if args.nixl_block_bytes < 4096 or args.nixl_block_bytes % 4096:
        raise InvalidArgumentError("--nixl-block-bytes", "must be a multiple of 4096")
    if 0 < args.nixl_pool_bytes < args.nixl_block_bytes or args.nixl_pool_bytes < 0:
        raise InvalidArgumentError("--nixl-pool-bytes", "must hold at least one block")
    nixl_api("--transport")  # NixlUnavailableError names the extra


def check_sim(args: argparse.Namespace) -> None:
    """A sim worker models exactly what its flags name, or refuses to start."""
    from pdserve.sim.backend import SimOptions  # imported only by sim workers

    if not args.sim_profile:
        raise InvalidArgumentError(
            "--sim-profile",
            "--backend sim needs a timing model: roofline:ACCEL:MODEL or fitted:FILE",
        )
    SimOptions.parse(args.sim_profile, args.sim_time_scale, args.sim_link)


def options_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> WorkerOptions:
    """Check the parsed flags and bundle them; ``InvalidArgumentError`` names the flag.
    ``env``: where the internal token may come from (``PDSERVE_INTERNAL_TOKEN``)."""
    if args.model is None:
        raise InvalidArgumentError("--model", "a checkpoint directory is required")
    role = WorkerRole(args.role)
    if role is WorkerRole.PREFILL and not args.kvstore:
        raise InvalidArgumentError("--kvstore", "a prefill worker needs a KV store address")
    if args.kvstore:
        check_address(args.kvstore, "--kvstore")  # mooncake:// without its package: refused
    if args.kv_blocks is not None and args.kv_cache_bytes is not None:
        raise InvalidArgumentError("--kv-blocks", "give --kv-blocks or --kv-cache-bytes, not both")
    if not args.janitor_interval_s > 0:
        raise InvalidArgumentError("--janitor-interval-s", "must be > 0")
    if not args.interactive_period_ms >= 0:
        raise InvalidArgumentError("--interactive-period-ms", "must be >= 0")
    if args.bulk_tokens < 0:
        raise InvalidArgumentError("--bulk-tokens", "must be >= 0")
    if args.lease_split_threads is not None and args.lease_split_threads < 0:
        raise InvalidArgumentError("--lease-split-threads", "must be >= 0")
    parse_faults(args.fault)  # refuse a bad spec at start
    check_backend(args)
    return WorkerOptions(
        model=args.model,
        role=role,
        backend=args.backend,
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        advertise_host=args.advertise_host,
        host_name=args.host_name,
        worker_id=args.worker_id,
        kvstore=args.kvstore,
        kv_lease_s=args.kv_lease_s,
        kv_timeout_s=args.kv_timeout_s,
        redis_url=args.redis_url,
        namespace=args.namespace,
        heartbeat_interval_s=args.heartbeat_interval_s,
        max_wait_ms=args.max_wait_ms,
        dtype=args.dtype,
        device=args.device,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        kv_cache_bytes=args.kv_cache_bytes,
        threads=args.threads,
        host_lease=args.host_lease,
        interactive_period_ms=args.interactive_period_ms,
        bulk_tokens=args.bulk_tokens,
        lease_split_threads=args.lease_split_threads,
        grace_s=args.grace_s,
        transport=args.transport,
        network_transport=args.network_transport,
        allow_shm=args.allow_shm,
        allow_recompute=args.allow_recompute,
        kv_compression=args.kv_compression,
        layerwise=args.layerwise,
        decode_prefix=args.decode_prefix,
        kv_prefetch=args.kv_prefetch,
        kv_prefetch_min_bytes=args.kv_prefetch_min_bytes,
        kv_transfer_timeout_s=args.kv_transfer_timeout_s,
        prefix_reuse=args.prefix_reuse,
        prefix_chunk_tokens=args.prefix_chunk_tokens,
        prefix_lease_s=args.prefix_lease_s,
        inbox_bytes=args.inbox_bytes,
        shm_slot_bytes=args.shm_slot_bytes,
        nixl_pool_bytes=args.nixl_pool_bytes,
        nixl_block_bytes=args.nixl_block_bytes,
        janitor_interval_s=args.janitor_interval_s,
        janitor_max_age_s=args.janitor_max_age_s,
        faults=tuple(args.fault),
        security=security_from_args(args, env or {}),
        trtllm_transceiver=args.trtllm_transceiver,
        trtllm_kv_fraction=args.trtllm_kv_fraction,
        scheduling=scheduling_options(args),
        sim_profile=args.sim_profile,
        sim_time_scale=args.sim_time_scale,
        sim_link=args.sim_link,
    )
