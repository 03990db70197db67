"""``python -m services.router``: the Router gRPC service, the cluster's public entry point.

Wiring only: flags -> telemetry (tracing from ``OTEL_*``, ``/metrics``) -> tokenizer and model
limits (no weights) -> the rollout split from Redis (``--redis-url``) -> RequestFlow -> gRPC
server (+ health, reflection) -> serve until SIGTERM/SIGINT. ``--port 0`` binds a free port;
``--port-file`` receives the bound port once the server is serving (``--metrics-port-file``
the metrics port, before it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from pathlib import Path

from pdserve.router import ChannelPool, FlowConfig, ModelLimits, RequestFlow
from pdserve.router.rollout import RolloutFollower, following
from pdserve.router.telemetry import RouterTelemetry
from pdserve.rpc.convert import mode_from_name
from pdserve.rpc.server import build_server, serve_until_signal, write_port_file
from pdserve.scheduling import KeySpace, connect
from pdserve.telemetry.metrics import RouterMetrics
from pdserve.telemetry.service import (
    MetricsEndpoint,
    ServiceTelemetry,
    add_telemetry_args,
)
from pdserve.telemetry.spans import SERVICE_ROUTER
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import router_pb2_grpc
from services.router.servicer import RouterServicer

logger = logging.getLogger("pdserve.router")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.router", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    p.add_argument("--scheduler", required=True, help="host:port of the Scheduler service")
    p.add_argument("--model", type=Path, required=True, help="checkpoint dir (tokenizer + config)")
    p.add_argument(
        "--mode",
        default="conditional",
        choices=["conditional", "disaggregated", "colocated"],
        help="mode asked of the scheduler when no rollout split applies (conditional: the "
        "scheduler decides per request)",
    )
    p.add_argument(
        "--redis-url",
        help="follow the rollout split (pdserve rollout) kept in this Redis; unset: --mode only",
    )
    p.add_argument("--namespace", default="pdserve", help="Redis key prefix of the cluster")
    p.add_argument("--max-channels", type=int, default=64, help="cached worker channels at most")
    p.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    add_telemetry_args(p, os.environ)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.from_dir(args.model)
    limits = ModelLimits.from_dir(args.model)
    metrics = RouterMetrics()
    telemetry = ServiceTelemetry.start(
        SERVICE_ROUTER, metrics.registry, host=args.host, endpoint=MetricsEndpoint.from_args(args)
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(telemetry.close)  # last: flushes the spans of the final requests
        arms = None
        if args.redis_url:
            redis = connect(args.redis_url)
            stack.push_async_callback(redis.aclose)
            arms = await stack.enter_async_context(
                following(RolloutFollower(redis, KeySpace(args.namespace)))
            )
        flow = RequestFlow(
            scheduler_address=args.scheduler,
            tokenizer=tokenizer,
            channels=ChannelPool(
                max_size=args.max_channels, interceptors=telemetry.client_interceptors()
            ),
            config=FlowConfig(mode=mode_from_name(args.mode)),
            arms=arms,
        )
        stack.push_async_callback(flow.close)
        servicer = RouterServicer(
            flow,
            tokenizer,
            limits,
            RouterTelemetry(metrics, tracer_provider=telemetry.tracer_provider),
        )
        server, port, health = build_server(
            [(router_pb2_grpc.add_RouterServicer_to_server, servicer)],
            port=args.port,
            host=args.host,
            interceptors=telemetry.server_interceptors(),
        )
        await server.start()
        await health.set_serving()
        logger.info(
            "router serving on %s:%d (scheduler %s, mode %s, model %s, metrics %s)",
            args.host, port, args.scheduler, args.mode, args.model, telemetry.metrics_url or "off",
        )  # fmt: skip
        if args.port_file is not None:
            write_port_file(args.port_file, port)
        await serve_until_signal(server, health, args.grace_s)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
