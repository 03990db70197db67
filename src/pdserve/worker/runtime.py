"""The life of a worker process, shared by the prefill and decode services.

``open_backend`` loads the model on the engine ``--backend`` names (the torch engine, its
steps gated by the host lease when one is configured and its prefix-cache changes logged when
they are to be published, or TensorRT-LLM) and starts it. ``run_worker`` then:

1. builds the gRPC server (the role's servicers + health + error mapping, behind the internal
   credential check and TLS of ``options.security``) and starts it; health says SERVING;
2. starts heartbeats into Redis (when a Redis URL is configured; a mixed worker's follow a
   planner's duty, ``duty``), the KV event publisher (``kv_events``), the shm janitor (once at
   once, then every ``janitor_interval_s``: segments of dead writers, or older than
   ``janitor_max_age_s``, are unlinked) and the caller's periodic sweeps, and writes the port
   file;
3. on SIGTERM/SIGINT: health NOT_SERVING, the heartbeat says ``draining``, the server stops
   taking calls and lets in-flight ones finish for up to ``grace_s``. Should the engine fail
   for good (``EngineBackend.failed``), health turns NOT_SERVING and the heartbeat says
   ``draining`` at once, so that nothing more is placed here; the process keeps answering
   (UNAVAILABLE) until it is stopped;
4. stops the heartbeats and deletes the worker's Redis key, and stops the periodic tasks.

The caller closes the engine (and its own clients) afterwards.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from pdserve.backends import SIM, TENSORRT_LLM, EngineBackend
from pdserve.backends.pytorch import TorchBackend, set_torch_threads, torch_threads
from pdserve.backends.tensorrt_llm_api import DEFAULT_BLOCK_SIZE, TensorRTLLMConfig, read_shape
from pdserve.compute import CoreSplit, HostLease
from pdserve.compute.lease import interactive_threads
from pdserve.engine.engine import Engine
from pdserve.engine.kv_payload import DTYPES
from pdserve.errors import InvalidArgumentError
from pdserve.handoff import DecodeConnector, PrefillConnector
from pdserve.handoff.agents import HeartbeatAgents
from pdserve.handoff.assignment import AssignedDecode
from pdserve.handoff.plan import NIXL_POOL_BYTES
from pdserve.kvstore.backend import StoreClient
from pdserve.prefix.store import PrefixReuse
from pdserve.prefix.store_blocks import StoreBlocks
from pdserve.rpc.server import (
    AddServicerFn,
    ServiceHealth,
    build_server,
    serve_until_signal,
    write_port_file,
)
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import RedisWorkerRegistry, connect
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.tasks import cancel_and_wait
from pdserve.transfer.bandwidth import BandwidthMeter
from pdserve.transfer.janitor import reclaim_orphans
from pdserve.transfer.links import Links
from pdserve.transfer.stream.inbox import Inbox
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.duty import Duty, capabilities
from pdserve.worker.fault_specs import parse_engine_faults
from pdserve.worker.heartbeat import WorkerHeartbeat, WorkerIdentity
from pdserve.worker.kv_events import KVEventPublisher, StoreEventPublisher, install_events
from pdserve.worker.options import WorkerOptions
from pdserve.worker.prefill import PrefillWorker
from pdserve.worker.worker_telemetry import WorkerTelemetry

logger = logging.getLogger(__name__)


def host_lease_dir(options: WorkerOptions) -> Path | None:
    """Where the worker's engine shares the host's cores (``--host-lease``); None without a
    lease, and for TensorRT-LLM, which runs on a GPU of its own. Sim engines that share a
    lease share the modelled device with their modelled steps, as the torch engines of one
    host share its cores (``sim.backend.sim_split``)."""
    return None if options.backend == TENSORRT_LLM else options.host_lease


async def open_backend(options: WorkerOptions) -> EngineBackend:
    """Load the model on the engine ``options.backend`` names (blocking: call before serving)
    and start it. A sim engine reads only the checkpoint's config and tokenizer."""
    backend: EngineBackend
    if options.backend == TENSORRT_LLM:
        from pdserve.backends.tensorrt_llm import TensorRTLLMBackend  # imports tensorrt_llm

        backend = TensorRTLLMBackend.from_pretrained(options.model, trtllm_config(options))
    elif options.backend == SIM:
        from pdserve.sim.backend import SimOptions, sim_backend

        lease_dir = host_lease_dir(options)
        sim = sim_backend(
            options.model,
            SimOptions.parse(options.sim_profile, options.sim_time_scale, options.sim_link),
            batch_window_ms=options.max_wait_ms,
            lease=None if lease_dir is None else functools.partial(host_lease, options, lease_dir),
            split_threads=options.lease_split_threads,
            **options.engine_config(),
        )
        if options.scheduling.kv_events and options.redis_url:
            install_events(sim.engine)
        backend = sim
    else:
        lease_dir = host_lease_dir(options)
        # Share the cores with the host's engines: split the threads, or take turns.
        gate = None if lease_dir is None else host_lease(options, lease_dir, torch_split(options))
        torch_backend = TorchBackend.from_pretrained(
            options.model,
            batch_window_ms=options.max_wait_ms,
            gate=gate,
            faults=parse_engine_faults(options.faults),
            **options.engine_config(),
        )
        if options.scheduling.kv_events and options.redis_url:
            install_events(torch_backend.engine)
        if options.record_steps is not None:
            record_steps(torch_backend.engine.engine, options.record_steps)
        backend = torch_backend
    await backend.start()
    return backend


def record_steps(engine: Engine, path: Path) -> None:
    """Append each step ``engine`` runs to ``path`` (``--record-steps``), with the threads
    the engine thread runs it on (a split's share, or all of them). The file stays open for
    the life of the process; each line is written whole."""
    from pdserve.sim.recording import RecordingRunner, StepLog

    engine.runner = RecordingRunner(engine.runner, StepLog(path, torch_threads))


def host_lease(
    options: WorkerOptions, lease_dir: Path, split: CoreSplit | None = None
) -> HostLease:
    """The gate by which this worker's engine shares the cores with the host's others,
    splitting the threads by ``split`` or, without one, taking turns."""
    return HostLease(
        lease_dir,
        interactive_period_s=options.interactive_period_ms / 1000.0,
        bulk_tokens=options.bulk_tokens,
        split=split,
    )


def torch_split(options: WorkerOptions) -> CoreSplit | None:
    """How the torch engine's threads split while a long prefill runs beside decode steps
    (``--lease-split-threads``); None where there is nothing to split."""
    threads = options.threads or torch_threads()
    keep = interactive_threads(threads, options.lease_split_threads)
    if keep == 0 or threads < 2:
        return None
    if keep >= threads:
        raise InvalidArgumentError(
            "--lease-split-threads", f"must be below the engine's {threads} threads, got {keep}"
        )
    return CoreSplit(threads=threads, interactive=keep, set_threads=set_torch_threads)


def trtllm_config(options: WorkerOptions) -> TensorRTLLMConfig:
    """The tensorrt-llm backend's settings these options give: the engine flags it shares with
    the torch backend (a KV budget in blocks or bytes becomes one in tokens) and its own."""
    kv_tokens = None
    block = options.block_size or DEFAULT_BLOCK_SIZE
    if options.kv_blocks is not None:
        kv_tokens = options.kv_blocks * block
    elif options.kv_cache_bytes is not None:
        shape = read_shape(options.model)
        itemsize = DTYPES.get(options.dtype, DTYPES["bfloat16"]).itemsize
        per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize
        kv_tokens = max(block, options.kv_cache_bytes // per_token)
    return TensorRTLLMConfig(
        dtype=options.dtype,
        max_num_batched_tokens=options.max_batch_tokens,
        max_num_seqs=options.max_num_seqs,
        block_size=options.block_size,
        kv_max_tokens=kv_tokens,
        free_gpu_memory_fraction=options.trtllm_kv_fraction,
        transceiver=options.trtllm_transceiver,
    )


def prefill_worker(
    options: WorkerOptions,
    engine: EngineBackend,
    store: StoreClient,
) -> PrefillWorker:
    """The prefill worker these options describe (hand-off settings, prefix reuse; with Redis,
    decode addresses checked against reservations). Its servicer traces its calls
    (``worker.stages``)."""
    prefix = (
        PrefixReuse(
            store,
            engine.layout,
            chunk_tokens=options.prefix_chunk_tokens,
            lease_s=options.prefix_lease_s,
            store_blocks=StoreBlocks(store.address, engine.layout.block_size),
        )
        if options.prefix_reuse
        else None
    )
    links = None
    if options.backend == SIM:  # the modelled link, not what moving the stand-in measures
        from pdserve.sim.backend import SimOptions

        sim = SimOptions.parse(options.sim_profile, options.sim_time_scale, options.sim_link)
        links = sim.links(options.host_name)
    connector = PrefillConnector(
        engine,
        store,
        host=options.host_name,
        options=options.transfer_options(),
        links=links,
        assignments=(
            AssignedDecode(connect(options.redis_url), KeySpace(options.namespace))
            if options.redis_url
            else None
        ),
    )
    return PrefillWorker(engine, connector, prefix=prefix)


def decode_worker(options: WorkerOptions, engine: EngineBackend) -> DecodeWorker:
    """The decode worker these options describe: its connector takes the ``direct`` hand-offs
    pushed into it (an inbox of ``inbox_bytes``, leases of ``kv_lease_s``), reads the others
    within ``kv_transfer_timeout_s`` (0: from the link) and serves the prefill workers'
    prefetches and prefix queries."""
    inbox = Inbox(
        options.inbox_bytes, expected_layout=engine.layout, default_lease_s=options.kv_lease_s
    )
    # nixl hand-offs: the prefill workers' agents, as their heartbeats publish them.
    agents = (
        HeartbeatAgents(
            RedisWorkerRegistry(connect(options.redis_url), keys=KeySpace(options.namespace))
        )
        if options.redis_url
        else None
    )
    connector = DecodeConnector(
        engine,
        inbox=inbox,
        host=options.host_name,
        store_timeout_s=options.kv_timeout_s,
        transfer_timeout_s=options.kv_transfer_timeout_s,
        security=options.security,
        agents=agents,
        nixl_bytes=options.nixl_pool_bytes or NIXL_POOL_BYTES,
        nixl_block_bytes=options.nixl_block_bytes,
        store_host=options.reach_host,
    )
    return DecodeWorker(engine, connector)


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


async def watch_engine(engine: EngineBackend, health: ServiceHealth) -> None:
    """Once the engine has failed for good: health NOT_SERVING (the heartbeat says
    ``draining`` by itself, from the engine's capacity)."""
    err = await engine.failed()
    logger.error("the engine failed for good (%r): health NOT_SERVING, no more placements", err)
    await health.set_not_serving()


async def run_worker(
    options: WorkerOptions,
    engine: EngineBackend,
    servicers: Sequence[tuple[AddServicerFn, object]],
    *,
    sweeps: Sequence[tuple[str, Callable[[], Awaitable[None]]]] = (),
    telemetry: WorkerTelemetry | None = None,
    links: Links | None = None,
    bandwidth: Sequence[BandwidthMeter] = (),
    kv_agent: tuple[str, str] = ("", ""),
    store_blocks: StoreBlocks | None = None,
) -> None:
    """Serve ``servicers`` until a signal, with heartbeats; see the module docstring.

    ``sweeps`` (name, coroutine function) run every second. With
    ``telemetry`` (started) calls are traced and failed heartbeats counted. ``links``: the
    KV links the worker's prefill side measured, for its heartbeats; ``bandwidth``: its
    connectors' meters, whose live bytes/s the heartbeats publish; ``kv_agent``: its prefill
    side's NIXL agent descriptor and fingerprint, for its heartbeats
    (``PrefillConnector.kv_agent``); ``store_blocks``: the KV store's prefix blocks its
    prefix reuse logs, published to the KV event stream.
    """
    server, port, health = build_server(
        servicers,
        port=options.port,
        host=options.host,
        interceptors=telemetry.server_interceptors() if telemetry is not None else (),
        security=options.security,
        auth=options.security.internal_auth(),
    )
    options.security.warn_if_open(f"{options.role.value} worker", options.host)
    identity = WorkerIdentity(
        id=options.identity_id(port),
        role=options.role,
        address=options.address(port),
        host=options.host_name,
        model_fingerprint=engine.fingerprint,
        max_batch_tokens=engine.max_num_batched_tokens,
        max_seqs=engine.max_num_seqs,
        lane=options.scheduling.lane,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        interactive_tokens=options.bulk_tokens if host_lease_dir(options) is not None else 0,
        transports=tuple(k.value for k in options.transfer_options().transports),
        kv_agent=kv_agent,
        prefix_store=(options.kvstore or "") if options.prefix_reuse else "",
    )
    keys = KeySpace(options.namespace)
    redis = connect(options.redis_url) if options.redis_url else None
    can = capabilities(options.role, can_prefill=options.kvstore is not None)
    migrate = options.scheduling.duty_switch == "migrate"
    duty = (
        Duty(
            options.role,
            can,
            options.scheduling.duty,
            hand_back=engine.hand_back if migrate else None,
        )
        if options.role is WorkerRole.MIXED
        else None
    )
    heartbeat = (
        WorkerHeartbeat(
            RedisWorkerRegistry(redis, keys=keys),
            identity,
            engine,
            interval_s=options.heartbeat_interval_s,
            duty=duty,
            links=links,
            bandwidth=bandwidth,
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
        *(asyncio.create_task(_every(1.0, work, name), name=name) for name, work in sweeps),
    ]
    # Only our own engine logs its prefix cache's changes (TensorRT-LLM's is its own).
    torch_engine = engine.engine if isinstance(engine, TorchBackend) else None
    if redis is not None and torch_engine is not None and torch_engine.block_events is not None:
        publisher = KVEventPublisher(
            redis, keys, identity.id, torch_engine, torch_engine.block_events
        )
        tasks.append(asyncio.create_task(publisher.run(), name="kv-events"))
    if redis is not None and store_blocks is not None:
        store_publisher = StoreEventPublisher(redis, keys, store_blocks)
        tasks.append(asyncio.create_task(store_publisher.run(), name="kvstore-events"))
    try:
        await server.start()
        await health.set_serving()
        # After SERVING, so that an engine that failed already turns it back at once.
        tasks.append(asyncio.create_task(watch_engine(engine, health), name="engine-watch"))
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
            await cancel_and_wait(task)
        await server.stop(None)  # no-op after a graceful stop; ends the server on errors
        if heartbeat is not None:
            await heartbeat.stop()
        if redis is not None:
            await redis.aclose()
