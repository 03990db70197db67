"""``python -m services.prefill``: a prefill worker.

Wiring only: flags (see ``pdserve.worker.options``; each defaults to ``PDSERVE_<FLAG>``) ->
engine backend -> KV store client -> Prefill service (``pdserve.adapters.prefill_servicer``, which
mixed workers serve too) -> serve with heartbeats until SIGTERM.
``--port 0`` binds a free port; ``--port-file`` receives the bound port once serving.
The KV hand-off flags (``--transport``, ``--prefix-reuse``, ...) are in
``docs/kv-transfer.md``.
"""

from __future__ import annotations

import logging
import os

from pdserve.adapters.prefill_servicer import PrefillServicer
from pdserve.kvstore.backend import open_store
from pdserve.rpc import allocator
from pdserve.rpc.server import run_service
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.telemetry.service import MetricsEndpoint, add_telemetry_args
from pdserve.telemetry.spans import SERVICE_PREFILL
from pdserve.v1 import prefill_pb2_grpc
from pdserve.worker.observability import SEND
from pdserve.worker.options import WorkerOptions, options_from_args, worker_parser
from pdserve.worker.runtime import open_backend, prefill_worker, run_worker
from pdserve.worker.stages import StageRecorder
from pdserve.worker.worker_telemetry import WorkerTelemetry


async def serve(options: WorkerOptions, endpoint: MetricsEndpoint | None = None) -> None:
    if options.kvstore is None:  # options_from_args checks it; keeps the types honest
        raise SystemExit("--kvstore is required")
    engine = await open_backend(options)
    telemetry = WorkerTelemetry.start(
        SERVICE_PREFILL, options.role.value, engine, host=options.host, endpoint=endpoint,
        model_name=options.model.name,
    )  # fmt: skip
    try:
        store = open_store(
            options.kvstore,
            timeout_s=options.kv_timeout_s,
            security=options.security,
            local_host=options.reach_host,
        )
        try:
            worker = prefill_worker(options, engine, store)
            telemetry.watch_bandwidth(SEND, worker.connector.bandwidth, worker.connector.links)
            try:
                servicer = PrefillServicer(worker, StageRecorder(telemetry))
                await run_worker(
                    options,
                    engine,
                    [(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer)],
                    sweeps=[("shm slot sweep", worker.connector.sweep)],
                    telemetry=telemetry,
                    links=worker.connector.links,
                    bandwidth=[worker.connector.bandwidth],
                    kv_agent=worker.connector.kv_agent,
                    store_blocks=worker.prefix.store_blocks if worker.prefix else None,
                )
            finally:
                await worker.close()
        finally:
            await store.close()
    finally:
        await engine.close()
        telemetry.close()


def main(argv: list[str] | None = None) -> None:
    parser = worker_parser(
        "python -m services.prefill",
        __doc__,
        roles=[WorkerRole.PREFILL],
        default_max_wait_ms=50.0,
        env=os.environ,
    )
    add_telemetry_args(parser, os.environ)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    allocator.tune_for_streams()  # MiB-sized KV messages: see pdserve.rpc.allocator
    options = options_from_args(args, os.environ)
    run_service(f"{options.role.value} worker", serve(options, MetricsEndpoint.from_args(args)))


if __name__ == "__main__":
    main()
