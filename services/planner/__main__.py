"""``python -m services.planner``: the online P:D planner (``pdserve.scheduling.planner``).

Wiring only: flags -> telemetry (``/metrics``: pressures, moves, leadership) -> Redis client ->
a gRPC health server (so launchers and orchestrators see it like any service) and the planner
loop (``planner_loop``) -> until SIGTERM/SIGINT, then the lease is given up. ``--dry-run`` logs
moves without ordering them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from pathlib import Path

from pdserve.rpc.server import build_server, run_service, serve_until_signal, write_port_file
from pdserve.scheduling.capacity import PREFILL_QUEUE_BATCHES, CapacityLimits
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.planner import Bounds, PlannerConfig, Profile
from pdserve.scheduling.planner_loop import Pass, PlannerLoop
from pdserve.scheduling.registry import connect
from pdserve.tasks import cancel_and_wait
from pdserve.telemetry.metrics import PlannerMetrics
from pdserve.telemetry.service import MetricsEndpoint, ServiceTelemetry, add_telemetry_args
from pdserve.telemetry.spans import SERVICE_PLANNER

logger = logging.getLogger("pdserve.planner")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.planner", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address of the health server")
    p.add_argument("--port", type=int, default=50053, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    p.add_argument(
        "--redis-url", default=os.environ.get("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument("--namespace", default="pdserve", help="Redis key prefix of the cluster")
    p.add_argument("--id", default=f"planner-{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between decisions")
    p.add_argument("--cooldown-s", type=float, default=10.0, help="seconds after a move")
    p.add_argument("--lease-ttl-s", type=float, default=5.0, help="leader lease lifetime")
    p.add_argument("--ttft-slo", type=float, default=3.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.150, help="seconds")
    p.add_argument("--high", type=float, default=0.6, help="pressure that asks for a worker")
    p.add_argument("--low", type=float, default=0.3, help="pressure below which a side gives one")
    p.add_argument("--min-prefill", type=int, default=1)
    p.add_argument("--max-prefill", type=int, default=1 << 30)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=1 << 30)
    p.add_argument(
        "--profile", action="append", default=[], metavar="H-H:prefill=A..B,decode=C..D",
        help="bounds for some hours of the day (local time), repeatable",
    )  # fmt: skip
    p.add_argument(
        "--prefill-queue-batches", type=float, default=PREFILL_QUEUE_BATCHES,
        help="the scheduler's flag of that name: a full queue is prefill pressure 1",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="log moves, order none")
    p.add_argument("--grace-s", type=float, default=2.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    add_telemetry_args(p, os.environ)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(
        ttft_slo_s=args.ttft_slo,
        itl_slo_s=args.itl_slo,
        high=args.high,
        low=args.low,
        cooldown_s=args.cooldown_s,
        bounds=Bounds(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode),
        profiles=tuple(Profile.parse(spec) for spec in args.profile),
        limits=CapacityLimits(prefill_queue_batches=args.prefill_queue_batches),
    )


async def serve(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    metrics = PlannerMetrics()
    telemetry = ServiceTelemetry.start(
        SERVICE_PLANNER, metrics.registry, host=args.host, endpoint=MetricsEndpoint.from_args(args)
    )
    redis = connect(args.redis_url)

    def observe(result: Pass) -> None:
        metrics.set_leader(result.leading)
        if result.pressure is not None:
            metrics.set_pressure(result.pressure.prefill, result.pressure.decode)
        for move in result.moves:
            metrics.count_move(move.duty, move.reason)

    loop = PlannerLoop(
        redis, KeySpace(args.namespace), config, holder=args.id, interval_s=args.interval_s,
        lease_ttl_s=args.lease_ttl_s, dry_run=args.dry_run, on_pass=observe,
    )  # fmt: skip
    try:
        server, port, health = build_server([], port=args.port, host=args.host)
        await server.start()
        await health.set_serving()
        task = asyncio.create_task(loop.run(), name="planner")
        logger.info("planner %s (redis %s, namespace %s, health on %s:%d)",
                    args.id, args.redis_url, args.namespace, args.host, port)  # fmt: skip
        if args.port_file is not None:
            write_port_file(args.port_file, port)
        try:
            await serve_until_signal(server, health, args.grace_s)
        finally:
            await cancel_and_wait(task)
    finally:
        await redis.aclose()
        telemetry.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_service("planner", serve(args))


if __name__ == "__main__":
    main()
