"""Load and checks for the failover tests (``test_failover.py``): a supervised cluster with a
spare of each worker role, requests streamed through the SDK while a process is killed, the
engine's own outputs to compare them with, and the checks that nothing is left behind."""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.client import AsyncClient, PdServeClientError, RetryPolicy
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster
from pdserve.service_process import ServiceProcess
from pdserve.supervisor import RestartPolicy
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from pdserve_bench.faults.leaks import holdings

INTERVAL_S = 0.5
"""The workers' heartbeat interval."""
WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", str(INTERVAL_S), "--janitor-interval-s", "0.5",
    # Hand-offs nobody takes (their router died) expire soon after the test's load.
    "--kv-lease-s", "5",
    # Requests named slow-* stall after one layer: certainly mid-hand-off when a kill comes,
    # then recomputed by the decode worker once the commit gives up.
    "--fault", "stall:1@slow-", "--kv-transfer-timeout-s", "4",
)  # fmt: skip
SCHEDULER_ARGS = ("--reservation-ttl-s", "5")  # releases lost with a dead process expire soon
RESTARTS = RestartPolicy(initial_backoff_s=0.2, max_backoff_s=2.0, poll_s=0.05)
RETRY = RetryPolicy(max_attempts=60, initial_backoff_s=0.05, max_backoff_s=0.5)
"""Clients ride out a restart: UNAVAILABLE before the first token is retried."""
NO_RETRY = RetryPolicy(max_attempts=1)
"""Clients that retry nothing: whatever rides out a fault is the cluster's doing."""
MAX_TOKENS = 96
LONG_STREAM = 320
"""Tokens of the streams a kill must catch mid-way: long enough that they outlast the
heartbeat (up to ``INTERVAL_S`` old) by which the test picks its victim, and short enough
that all eight of them fit one decode worker's 256 blocks when the other dies."""


def supervised(model: Path, **kwargs: object) -> Cluster:
    """Two prefill and two decode workers under a supervisor, as ``pdserve up`` runs them."""
    options: dict[str, object] = {
        "num_prefill": 2, "num_decode": 2, "worker_args": WORKER_ARGS,
        "scheduler_args": SCHEDULER_ARGS, "log_level": "WARNING", "supervise": True,
        "restart_policy": RESTARTS,
    }  # fmt: skip
    options.update(kwargs)
    return Cluster(model, **options)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Job:
    rid: str
    prompt: list[int]
    params: SamplingParams


def jobs(seed: int, n: int, *, prefix: str = "ok", max_tokens: int = MAX_TOKENS) -> list[Job]:
    """``n`` requests: greedy ones and seeded sampled ones (their draws follow the output
    position, so a migrated stream must continue them exactly)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, 2048) for _ in range(rng.randrange(20, 90))]
        sampled = i % 3 == 2
        params = SamplingParams(
            temperature=0.8 if sampled else 0.0,
            top_k=40 if sampled else 0,
            seed=1000 + i if sampled else None,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        out.append(Job(f"{prefix}-{seed}-{i}", prompt, params))
    return out


@dataclass(frozen=True, slots=True)
class Expected:
    tokens: list[int]
    text: str


def references(engine: Engine, batch: list[Job]) -> dict[str, Expected]:
    """What the engine alone gives for each job."""
    done = engine.generate([j.prompt for j in batch], [j.params for j in batch])
    return {j.rid: Expected(r.token_ids, r.text) for j, r in zip(batch, done, strict=True)}


@dataclass(slots=True)
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    completion_tokens: int = -1
    transport: str = ""
    restarts: int = 0
    """Times the caller started the request over after it broke mid-stream."""


class Load:
    """Streams jobs through the router; ``progress`` counts each one's tokens so far."""

    def __init__(
        self, address: str, *, restart_broken: bool = False, retry: RetryPolicy = RETRY
    ) -> None:
        self.client = AsyncClient(address, timeout=120, retry=retry)
        self.restart_broken = restart_broken
        """Start a request over when its stream breaks after tokens (no spare router)."""
        self.progress: dict[str, int] = {}

    async def one(self, client: AsyncClient, job: Job) -> Outcome:
        outcome = Outcome()
        while True:
            outcome.tokens, outcome.text = [], ""
            self.progress[job.rid] = 0
            p = job.params
            try:
                async with client.stream(
                    job.prompt, request_id=job.rid, max_tokens=p.max_tokens,
                    temperature=p.temperature, top_k=p.top_k, seed=p.seed, ignore_eos=True,
                ) as stream:  # fmt: skip
                    async for delta in stream:
                        outcome.tokens += delta.token_ids
                        outcome.text += delta.text
                        self.progress[job.rid] = len(outcome.tokens)
                        if delta.finish_reason is not None:
                            outcome.finish = delta.finish_reason
                            assert delta.usage is not None and delta.timing is not None
                            outcome.completion_tokens = delta.usage.completion_tokens
                            outcome.transport = delta.timing.transport
                return outcome
            except PdServeClientError as err:
                if not (self.restart_broken and err.code is grpc.StatusCode.UNAVAILABLE):
                    raise
                outcome.restarts += 1

    def start(self, batch: list[Job]) -> list[asyncio.Task[Outcome]]:
        return [asyncio.create_task(self.one(self.client, j), name=j.rid) for j in batch]

    async def run(self, batch: list[Job]) -> list[Outcome]:
        return list(await asyncio.gather(*self.start(batch)))

    def all_past(self, batch: list[Job], tokens: int) -> bool:
        return all(self.progress.get(j.rid, 0) >= tokens for j in batch)


def check(outcomes: list[Outcome], batch: list[Job], expected: dict[str, Expected]) -> None:
    """Every stream equals the undisturbed run: no token lost, none twice, same text."""
    for job, got in zip(batch, outcomes, strict=True):
        want = expected[job.rid]
        assert got.tokens == want.tokens, job.rid
        assert got.text == want.text, job.rid
        assert got.finish == "length" and got.completion_tokens == len(want.tokens), job.rid


async def until(
    probe: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 60
) -> None:
    """Poll ``probe`` (a plain or an async predicate) until it holds."""
    deadline = time.monotonic() + timeout_s

    async def holds() -> bool:
        result = probe()
        return await result if inspect.isawaitable(result) else bool(result)

    while not await holds():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # polling other processes: nothing to wait on


def kill(service: ServiceProcess) -> tuple[int, float]:
    """SIGKILL the service and reap it: its pid and the wall time it was certainly dead."""
    assert service.proc is not None
    pid = service.proc.pid
    service.proc.kill()
    service.proc.wait()
    return pid, time.time()


async def restarted(c: Cluster, name: str, times: int = 1) -> None:
    """Wait until the supervisor restarted ``name`` and the new process serves."""
    assert c.supervisor is not None
    supervisor = c.supervisor

    async def serving() -> bool:
        if supervisor.restarts(name) < times:
            return False
        service = next(s for s in c.services if s.name == name)
        return service.port_file.exists()  # written once it serves

    await until(serving, f"{name} to be restarted")


async def scheduler_view(address: str) -> list[scheduler_pb2.WorkerStatus]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        reply = await stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
    return list(reply.workers)


async def detected(c: Cluster, victim: ServiceProcess, killed_at: float) -> None:
    """In the scheduler's view the dead instance never shows a heartbeat older than two
    intervals (it is dropped by then), and the replacement registers on the same address."""
    port = f":{victim.port}"

    async def replaced() -> bool:
        mine = [w for w in await scheduler_view(c.scheduler_address) if w.address.endswith(port)]
        dead = [w for w in mine if w.ts < killed_at]
        for w in dead:
            assert w.heartbeat_age_s <= 2 * INTERVAL_S, (w.id, w.heartbeat_age_s)
        return not dead and any(w.ts >= killed_at for w in mine)

    await until(replaced, f"the scheduler to see {victim.name} replaced")


async def nothing_left(c: Cluster, *, dead_pids: set[int]) -> None:
    """Every worker back in Redis with all its KV blocks free and nothing running, no
    hand-off entry or pending write in the store or a decode worker's endpoint, no shm
    segment of the cluster's processes (dead ones included) holding a hand-off, and no live
    reservation (``bench.faults.leaks``)."""

    async def clean() -> bool:
        return (await holdings(c, dead_pids=dead_pids)).clean

    await until(clean, "the cluster to hold nothing")
