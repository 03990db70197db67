"""The life of a worker process, shared by the prefill and decode services.

``load_engine`` loads the model and starts the engine thread. ``run_worker`` then:

1. builds the gRPC server (the role's servicers + health + reflection + error mapping) and
   starts it; health says SERVING;
2. starts heartbeats into Redis (when a Redis URL is configured) and writes the port file;
3. on SIGTERM/SIGINT: health NOT_SERVING, the heartbeat says ``draining``, the server stops
   taking calls and lets in-flight ones finish for up to ``grace_s``;
4. stops the heartbeats and deletes the worker's Redis key.

The caller closes the engine (and its own clients) afterwards.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from pdserve.rpc.server import AddServicerFn, build_server, serve_until_signal
from pdserve.scheduling import KeySpace, RedisWorkerRegistry, connect
from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.heartbeat import WorkerHeartbeat, WorkerIdentity, kv_fingerprint
from pdserve.worker.options import WorkerOptions

logger = logging.getLogger(__name__)


def load_engine(options: WorkerOptions) -> AsyncEngine:
    """Load the model (blocking: call before serving) and start the engine thread."""
    engine = AsyncEngine.from_pretrained(
        options.model, batch_window_ms=options.max_wait_ms, **options.engine_config()
    )
    engine.start()
    return engine


def write_port_file(path: Path, port: int) -> None:
    """Write then rename, so that a reader never sees a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


async def run_worker(
    options: WorkerOptions,
    engine: AsyncEngine,
    servicers: Sequence[tuple[AddServicerFn, object]],
) -> None:
    """Serve ``servicers`` until a signal, with heartbeats; see the module docstring."""
    server, port, health = build_server(servicers, port=options.port, host=options.host)
    identity = WorkerIdentity(
        id=options.identity_id(port),
        role=options.role,
        address=options.address(port),
        host=options.host_name,
        model_fingerprint=kv_fingerprint(engine.layout),
        max_batch_tokens=engine.max_num_batched_tokens,
    )
    redis = connect(options.redis_url) if options.redis_url else None
    heartbeat = (
        WorkerHeartbeat(
            RedisWorkerRegistry(redis, keys=KeySpace(options.namespace)),
            identity,
            engine,
            interval_s=options.heartbeat_interval_s,
        )
        if redis is not None
        else None
    )

    async def drain() -> None:
        if heartbeat is not None:
            heartbeat.mark_draining()

    try:
        await server.start()
        await health.set_serving()
        if heartbeat is not None:
            heartbeat.start()
        logger.info(
            "%s worker %s serving on %s (model %s, fingerprint %s)",
            identity.role.value, identity.id, identity.address,
            options.model, identity.model_fingerprint,
        )  # fmt: skip
        if options.port_file is not None:
            write_port_file(options.port_file, port)
        await serve_until_signal(server, health, options.grace_s, on_drain=drain)
    finally:
        await server.stop(None)  # no-op after a graceful stop; ends the server on errors
        if heartbeat is not None:
            await heartbeat.stop()
        if redis is not None:
            await redis.aclose()
