"""``python -m services.kvstore``: the KVStore gRPC service.

Wiring only: flags (each defaults to a ``PDSERVE_KVSTORE_*`` environment variable; the security
flags to ``PDSERVE_TLS_*`` and ``PDSERVE_INTERNAL_TOKEN*``) -> KVStore -> gRPC server (+ health,
behind the internal credential check) -> serve until SIGTERM/SIGINT. A task sweeps expired
leases every ``--sweep-interval-s``. ``--port 0`` binds a free port; ``--port-file`` receives
the bound port once the server is serving.

Tiers: ``--capacity-bytes`` of RAM; with ``--disk-dir`` the least recently used entries that
nobody reads spill there, up to ``--disk-bytes`` (see ``pdserve.kvstore.store``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from pathlib import Path

from pdserve.kvstore.metrics import StoreCollector
from pdserve.kvstore.store import KVStore
from pdserve.kvstore.wire import add_kvstore_servicer
from pdserve.rpc import allocator
from pdserve.rpc.server import build_server, run_service, serve_until_signal, write_port_file
from pdserve.security.options import add_security_args, security_from_args
from pdserve.telemetry.service import MetricsEndpoint, add_telemetry_args
from pdserve.telemetry.spans import SERVICE_KVSTORE
from pdserve.worker.worker_telemetry import WorkerTelemetry
from services.kvstore.observed import ObservedKVStoreServicer

logger = logging.getLogger("pdserve.kvstore")


def _env(name: str, default: str) -> str:
    return os.environ.get(f"PDSERVE_KVSTORE_{name}", default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to bind")
    p.add_argument(
        "--port", type=int, default=int(_env("PORT", "50060")), help="0 picks a free port"
    )
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    p.add_argument(
        "--capacity-bytes", type=int, default=int(_env("CAPACITY_BYTES", str(4 * 1024**3))),
        help="RAM budget; a put that cannot fit (nothing left to spill) fails RESOURCE_EXHAUSTED",
    )  # fmt: skip
    p.add_argument(
        "--disk-dir", type=Path, default=_env("DISK_DIR", "") or None,
        help="spill directory (a subdirectory per store process); unset: RAM only",
    )  # fmt: skip
    p.add_argument(
        "--disk-bytes", type=int, default=int(_env("DISK_BYTES", str(16 * 1024**3))),
        help="budget of the spill directory",
    )  # fmt: skip
    p.add_argument(
        "--default-lease-s", type=float, default=float(_env("DEFAULT_LEASE_S", "60")),
        help="lifetime of a payload whose put asks for lease 0",
    )  # fmt: skip
    p.add_argument("--max-lease-s", type=float, default=float(_env("MAX_LEASE_S", "3600")))
    p.add_argument("--sweep-interval-s", type=float, default=float(_env("SWEEP_INTERVAL_S", "1")))
    p.add_argument("--chunk-bytes", type=int, default=int(_env("CHUNK_BYTES", str(1024 * 1024))))
    p.add_argument("--grace-s", type=float, default=float(_env("GRACE_S", "5")))
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    add_telemetry_args(p, os.environ)
    add_security_args(p, os.environ)
    return p.parse_args(argv)


async def _sweep_forever(store: KVStore, interval_s: float, collector: StoreCollector) -> None:
    while True:
        collector.publish(store.stats())  # the gauges and counters a scrape reads
        await asyncio.sleep(interval_s)  # a periodic timer, not synchronisation
        expired = store.sweep()
        if expired:
            logger.info("dropped %d payloads whose lease ran out", expired)


async def serve(args: argparse.Namespace) -> None:
    security = security_from_args(args, os.environ)
    security.warn_if_open("kvstore", args.host)
    telemetry = WorkerTelemetry.start(
        SERVICE_KVSTORE, "kvstore", host=args.host, endpoint=MetricsEndpoint.from_args(args)
    )
    store = KVStore(
        args.capacity_bytes,
        disk_dir=args.disk_dir,
        disk_bytes=args.disk_bytes,
        default_lease_s=args.default_lease_s,
        max_lease_s=args.max_lease_s,
    )
    collector = StoreCollector()  # pdserve_kvstore_*: tiers, entries, hit ratio, evictions
    telemetry.metrics.registry.register(collector)
    server, port, health = build_server(
        [
            (
                add_kvstore_servicer,
                ObservedKVStoreServicer(store, chunk_bytes=args.chunk_bytes, telemetry=telemetry),
            )
        ],
        port=args.port,
        host=args.host,
        interceptors=telemetry.server_interceptors(),
        security=security,
        auth=security.internal_auth(),
    )
    sweeper = asyncio.create_task(
        _sweep_forever(store, args.sweep_interval_s, collector), name="kv-sweeper"
    )
    try:
        await server.start()
        await health.set_serving()
        logger.info(
            "kvstore serving on %s:%d (capacity %d bytes)", args.host, port, args.capacity_bytes
        )
        if args.port_file is not None:
            write_port_file(args.port_file, port)
        await serve_until_signal(server, health, args.grace_s)
    finally:
        telemetry.close()
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        stats = store.stats()
        store.close()
        logger.info(
            "kvstore stopped: %d entries left, %d bytes in, %d out, %d hits, %d misses, "
            "%d expired, %d spilled, %d reloaded, %d evicted",
            stats.num_entries, stats.bytes_in, stats.bytes_out, stats.hits, stats.misses,
            stats.expired, stats.spills, stats.reloads, stats.evictions,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    allocator.tune_for_streams()  # MiB-sized KV messages: see pdserve.rpc.allocator
    run_service("kvstore", serve(args))


if __name__ == "__main__":
    main()
