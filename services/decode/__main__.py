"""``python -m services.decode``: a decode worker, or with ``--role mixed`` a colocated one.

Wiring only: flags (see ``pdserve.worker.options``; each defaults to ``PDSERVE_<FLAG>``) ->
engine thread -> Decode service (role mixed: also Mixed, and Prefill when ``--kvstore`` is
given) -> serve with heartbeats until SIGTERM. ``--port 0`` binds a free port; ``--port-file``
receives the bound port once serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from pdserve.kvstore.client import KVStoreClient
from pdserve.rpc.server import AddServicerFn
from pdserve.scheduling import WorkerRole
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.options import WorkerOptions, options_from_args, worker_parser
from pdserve.worker.prefill import PrefillWorker
from pdserve.worker.runtime import load_engine, run_worker
from services.decode.servicer import DecodeServicer, MixedServicer
from services.prefill.servicer import PrefillServicer


async def serve(options: WorkerOptions) -> None:
    engine = load_engine(options)
    worker = DecodeWorker(engine, store_timeout_s=options.kv_timeout_s)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(engine.close)
        stack.push_async_callback(worker.close)
        servicers: list[tuple[AddServicerFn, object]] = [
            (decode_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(worker))
        ]
        if options.role is WorkerRole.MIXED:
            servicers.append((decode_pb2_grpc.add_MixedServicer_to_server, MixedServicer(worker)))
            if options.kvstore:
                store = KVStoreClient(options.kvstore, timeout_s=options.kv_timeout_s)
                stack.push_async_callback(store.close)
                prefill = PrefillWorker(engine, store, lease_s=options.kv_lease_s)
                servicers.append(
                    (prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(prefill))
                )
        await run_worker(options, engine, servicers)


def main(argv: list[str] | None = None) -> None:
    parser = worker_parser(
        "python -m services.decode",
        __doc__,
        roles=[WorkerRole.DECODE, WorkerRole.MIXED],
        default_max_wait_ms=0.0,
        env=os.environ,
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(options_from_args(args)))


if __name__ == "__main__":
    main()
