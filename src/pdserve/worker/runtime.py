"""The life of a worker process, shared by the prefill and decode services.

``load_engine`` loads the model, gates its steps with the host lease when one is configured,
makes the engine log its prefix-cache changes when they are to be published, and starts the
engine thread. ``run_worker`` then:

1. builds the gRPC server (the role's servicers + health + reflection + error mapping) and
   starts it; health says SERVING;
2. starts heartbeats into Redis (when a Redis URL is configured; a mixed worker's follow a
   planner's duty, ``duty``), the KV event publisher (``kv_events``), the shm janitor (once at
   once, then every ``janitor_interval_s``: segments of dead writers, or older than
   ``janitor_max_age_s``, are unlinked) and the caller's periodic sweeps, and writes the port
   file;
3. on SIGTERM/SIGINT: health NOT_SERVING, the heartbeat says ``draining``, the server stops
   taking calls and lets in-flight ones finish for up to ``grace_s``;
4. stops the heartbeats and deletes the worker's Redis key, and stops the periodic tasks.

The caller closes the engine (and its own clients) afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from pdserve.compute import HostLease
from pdserve.kvstore.client import KVStoreClient
from pdserve.rpc.server import AddServicerFn, build_server, serve_until_signal, write_port_file
from pdserve.scheduling import KeySpace, RedisWorkerRegistry, WorkerRole, connect
from pdserve.transfer.janitor import reclaim_orphans
from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.decode_stubs import DecodeStubs
from pdserve.worker.duty import Duty, capabilities
from pdserve.worker.heartbeat import Links, WorkerHeartbeat, WorkerIdentity, kv_fingerprint
from pdserve.worker.kv_events import KVEventPublisher, install_events
from pdserve.worker.observability import WorkerTelemetry
from pdserve.worker.options import WorkerOptions
from pdserve.worker.prefill import PrefillWorker
from pdserve.worker.prefix import PrefixReuse
from pdserve.worker.traced import TracedPrefillWorker

logger = logging.getLogger(__name__)


def load_engine(options: WorkerOptions) -> AsyncEngine:
    """Load the model (blocking: call before serving) and start the engine thread."""
    engine = AsyncEngine.from_pretrained(
        options.model, batch_window_ms=options.max_wait_ms, **options.engine_config()
    )
    if options.host_lease is not None:  # take turns on the cores with the host's other engines
        engine.engine.gate = HostLease(
            options.host_lease,
            interactive_period_s=options.interactive_period_ms / 1000.0,
            bulk_tokens=options.bulk_tokens,
        )
    if options.scheduling.kv_events and options.redis_url:
        install_events(engine)
    engine.start()
    return engine


def prefill_worker(
    options: WorkerOptions,
    engine: AsyncEngine,
    store: KVStoreClient,
    telemetry: WorkerTelemetry | None = None,
) -> PrefillWorker:
    """The prefill worker these options describe (hand-off settings, prefix reuse); it traces
    its stages and counts its transfers into ``telemetry``."""
    prefix = (
        PrefixReuse(
            store,
            engine.layout,
            chunk_tokens=options.prefix_chunk_tokens,
            lease_s=options.prefix_lease_s,
        )
        if options.prefix_reuse
        else None
    )
    return TracedPrefillWorker(
        engine,
        store,
        lease_s=options.kv_lease_s,
        host=options.host_name,
        options=options.transfer_options(),
        prefix=prefix,
        announcers=DecodeStubs() if options.kv_prefetch else None,
        telemetry=telemetry,
    )


async def reclaim_shm(max_age_s: float) -> None:
    """One janitor pass over ``/dev/shm``; logs what it unlinked."""
    removed = await asyncio.to_thread(reclaim_orphans, max_age_s=max_age_s)
    for seg in removed:
        logger.info(
            "reclaimed shm segment %s (%d bytes, %s, owner %s)",
            seg.name, seg.num_bytes, seg.reason.value, seg.owner_pid,
        )  # fmt: skip


async def _every(interval_s: float, work: Callable[[], Awaitable[None]], what: str) -> None:
    """Run ``work`` now and then every ``interval_s`` until cancelled; failures are logged."""
    while True:
        try:
            await work()
        except Exception:  # a failed pass must not end the loop; the next one retries
            logger.exception("periodic %s failed", what)
        await asyncio.sleep(interval_s)  # a timer, not synchronisation


async def run_worker(
    options: WorkerOptions,
    engine: AsyncEngine,
    servicers: Sequence[tuple[AddServicerFn, object]],
    *,
    on_bound: Callable[[str], None] | None = None,
    sweeps: Sequence[tuple[str, Callable[[], Awaitable[None]]]] = (),
    sweep_interval_s: float = 1.0,
    telemetry: WorkerTelemetry | None = None,
    links: Links | None = None,
) -> None:
    """Serve ``servicers`` until a signal, with heartbeats; see the module docstring.

    ``on_bound`` receives the worker's advertised address once the port is bound, before it
    serves. ``sweeps`` (name, coroutine function) run every ``sweep_interval_s``. With
    ``telemetry`` (started) calls are traced and failed heartbeats counted. ``links``: the
    KV links the worker's prefill side measured, for its heartbeats.
    """
    server, port, health = build_server(
        servicers,
        port=options.port,
        host=options.host,
        interceptors=telemetry.server_interceptors() if telemetry is not None else (),
    )
    if on_bound is not None:
        on_bound(options.address(port))
    identity = WorkerIdentity(
        id=options.identity_id(port),
        role=options.role,
        address=options.address(port),
        host=options.host_name,
        model_fingerprint=kv_fingerprint(engine.layout),
        max_batch_tokens=engine.max_num_batched_tokens,
        lane=options.scheduling.lane,
        kv_bytes_per_token=engine.layout.num_layers * engine.layout.bytes_per_token_per_layer,
    )
    keys = KeySpace(options.namespace)
    redis = connect(options.redis_url) if options.redis_url else None
    can = capabilities(options.role, can_prefill=options.kvstore is not None)
    heartbeat = (
        WorkerHeartbeat(
            RedisWorkerRegistry(redis, keys=keys),
            identity,
            engine,
            interval_s=options.heartbeat_interval_s,
            duty=(
                Duty(options.role, can, options.scheduling.duty)
                if options.role is WorkerRole.MIXED
                else None
            ),
            links=links,
        )
        if redis is not None
        else None
    )

    async def drain() -> None:
        if heartbeat is not None:
            heartbeat.mark_draining()

    tasks = [
        asyncio.create_task(
            _every(
                options.janitor_interval_s,
                lambda: reclaim_shm(options.janitor_max_age_s),
                "shm janitor",
            ),
            name="shm-janitor",
        ),
        *(
            asyncio.create_task(_every(sweep_interval_s, work, name), name=name)
            for name, work in sweeps
        ),
    ]
    if redis is not None and engine.block_events is not None:
        publisher = KVEventPublisher(redis, keys, identity.id, engine, engine.block_events)
        tasks.append(asyncio.create_task(publisher.run(), name="kv-events"))
    try:
        await server.start()
        await health.set_serving()
        if heartbeat is not None:
            heartbeat.start()
            if telemetry is not None:
                telemetry.watch_heartbeat(heartbeat)
        logger.info(
            "%s worker %s serving on %s (model %s, fingerprint %s)",
            identity.role.value, identity.id, identity.address,
            options.model, identity.model_fingerprint,
        )  # fmt: skip
        if options.port_file is not None:
            write_port_file(options.port_file, port)
        await serve_until_signal(server, health, options.grace_s, on_drain=drain)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(None)  # no-op after a graceful stop; ends the server on errors
        if heartbeat is not None:
            await heartbeat.stop()
        if redis is not None:
            await redis.aclose()
