"""Command-line options of the worker services (``services.prefill``, ``services.decode``).

Both services take the same flags, so they are declared once here. Every flag defaults to an
environment variable ``PDSERVE_<FLAG>`` (``--redis-url`` <- ``PDSERVE_REDIS_URL``); the
services pass ``os.environ`` in, the library itself reads no environment.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling import WorkerRole

ENV_PREFIX = "PDSERVE_"


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Everything a worker process is configured with."""

    model: Path
    role: WorkerRole
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
    """host:port of the KV store prefills write to (required for role prefill)."""
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
    grace_s: float = 10.0
    """On SIGTERM, how long in-flight requests may take to finish."""

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
        return {k: v for k, v in fields.items() if v is not None}

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
    p.add_argument("--kvstore", default=d("kvstore"), help="KV store host:port (prefill)")
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
    p.add_argument("--grace-s", type=float, default=float(d("grace_s", 10.0)), help="drain time")
    p.add_argument("--log-level", default=d("log_level", "INFO"))
    return p


def _int(value: str | None) -> int | None:
    return None if value is None else int(value)


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    """Check the parsed flags and bundle them; ``InvalidArgumentError`` names the flag."""
    if args.model is None:
        raise InvalidArgumentError("--model", "a checkpoint directory is required")
    role = WorkerRole(args.role)
    if role is WorkerRole.PREFILL and not args.kvstore:
        raise InvalidArgumentError("--kvstore", "a prefill worker needs a KV store address")
    if args.kv_blocks is not None and args.kv_cache_bytes is not None:
        raise InvalidArgumentError("--kv-blocks", "give --kv-blocks or --kv-cache-bytes, not both")
    return WorkerOptions(
        model=args.model,
        role=role,
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
        grace_s=args.grace_s,
    )
