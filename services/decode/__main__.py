"""``python -m services.decode``: a decode worker, or with ``--role mixed`` a colocated one.

Wiring only: flags (see ``pdserve.worker.options``; each defaults to ``PDSERVE_<FLAG>``) ->
engine backend -> decode worker and its hand-off connector (``pdserve.handoff.decode``) ->
Decode service, whose ``Push`` takes the ``direct`` hand-offs prefill workers stream in,
assembled as they land (``pdserve.transfer.stream.inbox``; ``--inbox-bytes`` of RAM, leases
swept every second), and whose ``CachedPrefix`` answers prefill workers' prefix queries;
role mixed: also Mixed, and Prefill when ``--kvstore`` is given -> serve with heartbeats until
SIGTERM. ``--port 0`` binds a free port; ``--port-file`` receives the bound port once serving.
"""

from __future__ import annotations

import contextlib
import logging
import os

from pdserve.adapters.prefill_servicer import PrefillServicer
from pdserve.kvstore.backend import open_store
from pdserve.rpc import allocator
from pdserve.rpc.server import AddServicerFn, run_service
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.telemetry.service import MetricsEndpoint, add_telemetry_args
from pdserve.telemetry.spans import SERVICE_DECODE
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc
from pdserve.worker.observability import RECV, SEND
from pdserve.worker.options import WorkerOptions, options_from_args, worker_parser
from pdserve.worker.runtime import decode_worker, open_backend, prefill_worker, run_worker
from pdserve.worker.stages import StageRecorder
from pdserve.worker.worker_telemetry import WorkerTelemetry
from services.decode.servicer import DecodeServicer, MixedServicer, add_decode_servicer


async def serve(options: WorkerOptions, endpoint: MetricsEndpoint | None = None) -> None:
    engine = await open_backend(options)
    telemetry = WorkerTelemetry.start(
        SERVICE_DECODE, options.role.value, engine, host=options.host, endpoint=endpoint,
        model_name=options.model.name,
    )  # fmt: skip
    stages = StageRecorder(telemetry)  # the calls' spans and transfer metrics
    worker = decode_worker(options, engine)
    telemetry.watch_bandwidth(RECV, worker.connector.bandwidth, worker.connector.links)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(telemetry.close)
        stack.push_async_callback(engine.close)
        stack.push_async_callback(worker.close)
        servicers: list[tuple[AddServicerFn, object]] = [
            (add_decode_servicer, DecodeServicer(worker, stages)),
        ]

        links = None
        kv_agent = ("", "")
        store_blocks = None
        meters = [worker.connector.bandwidth]
        sweeps = [("hand-off sweep", worker.connector.sweep)]
        if options.role is WorkerRole.MIXED:
            servicers.append(
                (decode_pb2_grpc.add_MixedServicer_to_server, MixedServicer(worker, stages))
            )
            if options.kvstore:
                store = open_store(
                    options.kvstore,
                    timeout_s=options.kv_timeout_s,
                    security=options.security,
                    local_host=options.reach_host,
                )
                stack.push_async_callback(store.close)
                prefill = prefill_worker(options, engine, store)
                stack.push_async_callback(prefill.close)
                links = prefill.connector.links
                kv_agent = prefill.connector.kv_agent
                store_blocks = prefill.prefix.store_blocks if prefill.prefix else None
                telemetry.watch_bandwidth(SEND, prefill.connector.bandwidth, links)
                meters.append(prefill.connector.bandwidth)
                sweeps.append(("shm slot sweep", prefill.connector.sweep))
                servicers.append(
                    (
                        prefill_pb2_grpc.add_PrefillServicer_to_server,
                        PrefillServicer(prefill, stages),
                    )
                )

        await run_worker(
            options,
            engine,
            servicers,
            sweeps=sweeps,
            telemetry=telemetry,
            links=links,
            bandwidth=meters,
            kv_agent=kv_agent,
            store_blocks=store_blocks,
        )


def main(argv: list[str] | None = None) -> None:
    parser = worker_parser(
        "python -m services.decode",
        __doc__,
        roles=[WorkerRole.DECODE, WorkerRole.MIXED],
        default_max_wait_ms=0.0,
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
