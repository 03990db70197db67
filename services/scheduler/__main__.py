"""``python -m services.scheduler``: the Scheduler gRPC service.

Wiring only: flags -> telemetry (tracing from ``OTEL_*``, ``/metrics``) -> Redis client ->
ClusterScheduler (tenant quotas from ``--api-keys`` and the ``--tenant-*`` flags; its view kept
fresh, the KV event index following the workers' stream) -> gRPC server
(+ health, behind the internal credential check) -> serve until SIGTERM/SIGINT. Health says
NOT_SERVING while Redis does not answer (the background refresh of the view tells).
``--port 0`` binds a free port; ``--port-file`` receives the bound port once the server is
serving, so a launcher can wait for that file (``--metrics-port-file`` is written before it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path

from pdserve.quotas import TenantQuota, TenantQuotas
from pdserve.rpc.server import build_server, run_service, serve_until_signal, write_port_file
from pdserve.scheduling.capacity import PREFILL_QUEUE_BATCHES, CapacityLimits
from pdserve.scheduling.costmodel import CostModel
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.policies import POLICIES
from pdserve.scheduling.prefix_index import PrefixIndex, following
from pdserve.scheduling.redis_url import redacted
from pdserve.scheduling.refresher import kept_fresh
from pdserve.scheduling.registry import connect
from pdserve.scheduling.scheduler import ClusterScheduler, Mode
from pdserve.security.apikeys import ApiKeys
from pdserve.security.options import add_security_args, security_from_args
from pdserve.telemetry.metrics import SchedulerMetrics
from pdserve.telemetry.service import (
    MetricsEndpoint,
    ServiceTelemetry,
    add_telemetry_args,
)
from pdserve.telemetry.spans import SERVICE_SCHEDULER
from pdserve.v1 import scheduler_pb2_grpc
from services.scheduler.servicer import SchedulerServicer

logger = logging.getLogger("pdserve.scheduler")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50052, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    p.add_argument(
        "--redis-url",
        default=os.environ.get("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="redis://[user:password@]host:port/db or rediss:// (TLS); default "
        "$PDSERVE_REDIS_URL (keeps a password off the command line)",
    )
    p.add_argument("--namespace", default="pdserve", help="Redis key prefix of the cluster")
    p.add_argument("--policy", default="kv_aware", choices=sorted(POLICIES))
    p.add_argument(
        "--default-mode",
        default=Mode.CONDITIONAL.value,
        choices=[m.value for m in Mode],
        help="mode of requests that name none (conditional: decided per request)",
    )
    s = p.add_argument_group("SLOs and lanes (docs/scheduling.md)")
    s.add_argument(
        "--ttft-slo",
        type=float,
        default=0.0,
        help="refuse (RESOURCE_EXHAUSTED) a request whose predicted time to first token "
        "exceeds this many seconds on every worker; 0: admit whatever fits",
    )
    s.add_argument(
        "--itl-slo",
        type=float,
        default=0.150,
        help="seconds between tokens a prefill may not push running streams past",
    )
    s.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=0,
        help="prompts longer than this go to long-lane prefill workers; 0: from the cost model",
    )
    s.add_argument(
        "--no-kv-index",
        dest="kv_index",
        action="store_false",
        help="do not follow the workers' KV events (no prefix-aware placement)",
    )
    p.add_argument("--refresh-interval-s", type=float, default=0.25)
    p.add_argument("--reservation-ttl-s", type=float, default=120.0)
    p.add_argument(
        "--reservation-max-lifetime-s", type=float, default=3600.0,
        help="no Renew extends a reservation past this long after its creation",
    )  # fmt: skip
    q = p.add_argument_group("tenant quotas (docs/security.md)")
    q.add_argument(
        "--api-keys", type=Path, default=os.environ.get("PDSERVE_API_KEYS") or None,
        help="the router's keys file: its 'tenants' and 'default_quota' set the quotas",
    )  # fmt: skip
    q.add_argument(
        "--tenant-max-reservations", type=int, default=0,
        help="live reservations per tenant at most (default quota; 0: no cap)",
    )  # fmt: skip
    q.add_argument(
        "--tenant-max-kv-blocks", type=int, default=0,
        help="decode KV blocks reserved per tenant at most (default quota; 0: no cap)",
    )  # fmt: skip
    p.add_argument("--max-retries", type=int, default=8)
    p.add_argument(
        "--prefill-queue-batches", type=float, default=PREFILL_QUEUE_BATCHES,
        help="a prefill worker's queue holds at most this many forward batches of prompt tokens",
    )  # fmt: skip
    p.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    add_telemetry_args(p, os.environ)
    add_security_args(p, os.environ)
    return p.parse_args(argv)


def quotas_from_args(args: argparse.Namespace) -> TenantQuotas:
    """The keys file's quotas; a tenant it does not list (and every tenant without a file)
    gets the ``--tenant-*`` flags' quota, unless the file has a ``default_quota``."""
    flags = TenantQuota(args.tenant_max_reservations, args.tenant_max_kv_blocks)
    if args.api_keys is None:
        return TenantQuotas(flags)
    from_file = ApiKeys.from_file(args.api_keys).quotas
    default = from_file.default if from_file.default.limited else flags
    return TenantQuotas(default, from_file.per_tenant)


async def serve(args: argparse.Namespace) -> None:
    security = security_from_args(args, os.environ)
    security.warn_if_open("scheduler", args.host)
    metrics = SchedulerMetrics()
    telemetry = ServiceTelemetry.start(
        SERVICE_SCHEDULER,
        metrics.registry,
        host=args.host,
        endpoint=MetricsEndpoint.from_args(args),
    )
    redis = connect(args.redis_url)
    try:
        scheduler = ClusterScheduler(
            redis,
            keys=KeySpace(args.namespace),
            policy=args.policy,
            refresh_interval_s=args.refresh_interval_s,
            reservation_ttl_s=args.reservation_ttl_s,
            max_retries=args.max_retries,
            limits=CapacityLimits(prefill_queue_batches=args.prefill_queue_batches),
            default_mode=Mode(args.default_mode),
            quotas=quotas_from_args(args),
            reservation_max_lifetime_s=args.reservation_max_lifetime_s,
            model=CostModel(itl_slo_s=args.itl_slo),
            long_prompt_tokens=args.long_prompt_tokens,
            ttft_slo_s=args.ttft_slo,
            prefix_index=PrefixIndex() if args.kv_index else None,
        )
        server, port, health = build_server(
            [
                (
                    scheduler_pb2_grpc.add_SchedulerServicer_to_server,
                    SchedulerServicer(scheduler, metrics),
                )
            ],
            port=args.port,
            host=args.host,
            interceptors=telemetry.server_interceptors(),
            security=security,
            auth=security.internal_auth(),
        )
        await server.start()
        await health.set_serving()
        logger.info(
            "scheduler serving on %s:%d (redis %s, namespace %s, policy %s, metrics %s)",
            args.host, port, redacted(args.redis_url), args.namespace, args.policy,
            telemetry.metrics_url or "off",
        )  # fmt: skip
        if args.port_file is not None:
            write_port_file(args.port_file, port)
        draining = False

        async def reachable(ok: bool) -> None:
            # Without Redis no request can be placed: say so, until it answers again.
            if not draining:
                await (health.set_serving() if ok else health.set_not_serving())

        async def drain() -> None:
            nonlocal draining
            draining = True
            await health.set_not_serving()  # again: a refresh may have come in between

        async with contextlib.AsyncExitStack() as running:
            # assign finds the view fresh; health follows Redis
            await running.enter_async_context(kept_fresh(scheduler, on_reachable=reachable))
            if scheduler.prefix_index is not None:
                await running.enter_async_context(
                    following(scheduler.prefix_index, redis, scheduler.keys)
                )
            await serve_until_signal(server, health, args.grace_s, on_drain=drain)
    finally:
        await redis.aclose()
        telemetry.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_service("scheduler", serve(args))


if __name__ == "__main__":
    main()
