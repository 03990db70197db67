"""``pdserve bench overhead``: what the service path adds on top of the engine.

The same requests run through the full disaggregated path (client -> router -> scheduler ->
prefill worker -> KV store -> decode worker -> client, real processes on real sockets) and
through one in-process engine, alternately, one at a time, so neither competes with the other
for the CPU. Per request:

    added = e2e(service path) - e2e(engine alone)
    overhead = added - transfer_ms   (the KV bytes' own time, measured by the workers)

``overhead`` is what router + scheduler + Redis + the hand-off's bookkeeping cost; the
transfer itself is reported beside it, never folded in.

Beside it, the floor of the design on this machine: the calls a request makes one after the
other (``CRITICAL_PATH``) times a bare round trip of each kind, measured in the same run (a
gRPC health check against the router, a Redis ``PING``). No service path of this shape can
add less than that here, whatever its own code costs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SETTLE_S = 0.02
"""Pause between a request's service-path run and its engine-alone run (see ``measure``)."""

CRITICAL_PATH = (
    "client -> router",
    "router -> scheduler (Assign)",
    "router -> prefill worker",
    "prefill worker -> decode worker (which prompt prefix it holds: Lookup)",
    "router -> decode worker",
)
"""The gRPC calls of one request that wait for each other: each call's answer (or, for the
streams, its last message) comes back before, or as, the request's own answer does."""
CRITICAL_PATH_REDIS = 2
"""Redis round trips inside Assign: the optimistic re-check (WATCH and the re-reads,
pipelined), then MULTI/EXEC."""
ROUND_TRIPS = 300
"""Bare round trips measured of each kind (after 30 to warm up)."""


@dataclass(frozen=True, slots=True)
class OverheadResult:
    prompt_tokens: int
    max_tokens: int
    requests: int
    engine_ms: list[float]
    service_ms: list[float]
    transfer_ms: list[float]
    transfer_bytes: int
    engine_ttft_ms: list[float]
    service_ttft_ms: list[float]
    grpc_rtt_ms: list[float]
    """Bare gRPC round trips (a health check against the router)."""
    redis_rtt_ms: list[float]
    """Bare Redis round trips (``PING``)."""

    @property
    def floor_ms(self) -> float:
        """The least a service path of this shape can add here: the critical path's round
        trips, each at its kind's median."""
        grpc = len(CRITICAL_PATH) * statistics.median(self.grpc_rtt_ms)
        return grpc + CRITICAL_PATH_REDIS * statistics.median(self.redis_rtt_ms)

    @property
    def added_ttft_ms(self) -> list[float]:
        return [s - e for s, e in zip(self.service_ttft_ms, self.engine_ttft_ms, strict=True)]

    @property
    def added_ms(self) -> list[float]:
        return [s - e for s, e in zip(self.service_ms, self.engine_ms, strict=True)]

    @property
    def overhead_ms(self) -> list[float]:
        return [a - t for a, t in zip(self.added_ms, self.transfer_ms, strict=True)]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def measure(
    model_dir: Path,
    *,
    prompt_tokens: int,
    max_tokens: int,
    requests: int,
    dtype: str,
    threads: int | None,
) -> OverheadResult:
    import torch

    from pdserve.client import Client
    from pdserve.engine.engine import Engine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.launcher import Cluster

    worker_args = ["--dtype", dtype]
    if threads is not None:
        worker_args += ["--threads", str(threads)]
    engine = Engine.from_pretrained(
        model_dir, dtype=dtype, num_threads=threads, enable_prefix_caching=False
    )
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, vocab, (prompt_tokens,), generator=g).tolist() for _ in range(requests + 2)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng_ms: list[float] = []
    svc_ms: list[float] = []
    eng_ttft: list[float] = []
    svc_ttft: list[float] = []
    xfer_ms: list[float] = []
    xfer_bytes = 0

    def run_engine(rid: str, prompt: list[int]) -> tuple[list[int], float]:
        """Greedy tokens and the time to the first one, on the in-process engine."""
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, params)
        tokens: list[int] = []
        first = 0.0
        while engine.has_unfinished():
            for out in engine.step():
                if not tokens and out.new_token_ids:
                    first = time.perf_counter() - t0
                tokens += out.new_token_ids
        return tokens, first

    with (
        Cluster(model_dir, num_prefill=1, num_decode=1, worker_args=worker_args) as cluster,
        Client(cluster.router_address) as client,
    ):
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            stream = client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            first_at = 0.0
            for delta in stream:
                if not first_at and delta.token_ids:
                    first_at = time.perf_counter()
            done = stream.completion()
            t1 = time.perf_counter()
            # Work the services still do once the client's call has ended (the workers' own
            # bookkeeping after their last message) must not slow the engine-alone run that
            # follows: a slower baseline would flatter the overhead.
            time.sleep(SETTLE_S)
            t_engine = time.perf_counter()
            ref_tokens, ref_first = run_engine(f"ref{i}", prompt)
            t2 = time.perf_counter()
            if done.token_ids != ref_tokens:
                pairs = zip(done.token_ids, ref_tokens, strict=False)  # lengths may differ
                at = next(
                    (j for j, (a, b) in enumerate(pairs) if a != b),
                    min(len(done.token_ids), len(ref_tokens)),
                )
                how = done.timing.transport if done.timing is not None else "?"
                raise RuntimeError(
                    f"request {i}: the service path and the engine disagree from output "
                    f"token {at} (hand-off: {how}): {done.token_ids} vs {ref_tokens}"
                )
            if done.timing is None:
                raise RuntimeError(f"request {i}: the router sent no timing breakdown")
            if i < 2:  # warm-up: first requests pay for channel set-up and allocator growth
                continue
            svc_ms.append((t1 - t0) * 1e3)
            eng_ms.append((t2 - t_engine) * 1e3)
            svc_ttft.append((first_at - t0) * 1e3)
            eng_ttft.append(ref_first * 1e3)
            xfer_ms.append(done.timing.transfer_ms)
            xfer_bytes = done.timing.transfer_bytes
        if cluster.redis_url is None:  # set once the cluster started
            raise RuntimeError("the cluster started without a Redis URL")
        grpc_rtt = asyncio.run(grpc_round_trips(cluster.router_address, ROUND_TRIPS))
        redis_rtt = asyncio.run(redis_round_trips(cluster.redis_url, ROUND_TRIPS))
    return OverheadResult(
        prompt_tokens, max_tokens, requests, eng_ms, svc_ms, xfer_ms, xfer_bytes, eng_ttft,
        svc_ttft, grpc_rtt, redis_rtt,
    )  # fmt: skip


async def grpc_round_trips(address: str, n: int) -> list[float]:
    """``n`` health checks against the gRPC server at ``address`` (a unary call through
    grpcio's asyncio API, as the services make theirs), in ms each."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest()
        return await _timed(lambda: stub.Check(check, timeout=10.0), n)


async def redis_round_trips(url: str, n: int) -> list[float]:
    """``n`` ``PING``s to the Redis server at ``url`` (redis-py's asyncio client, as the
    scheduler's), in ms each."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_timeout=10.0)
    try:
        return await _timed(client.ping, n)
    finally:
        await client.aclose()


async def _timed(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    """``n`` timed awaits of ``call()`` (ms each), after 30 untimed ones."""
    for _ in range(30):
        await call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def format_result(r: OverheadResult) -> str:
    def row(name: str, values: Sequence[float]) -> str:
        return (
            f"{name:<34}{statistics.median(values):>10.2f}{percentile(values, 99):>10.2f}"
            f"{statistics.mean(values):>10.2f}"
        )

    lines = [
        f"{r.requests} sequential requests, prompt {r.prompt_tokens} tokens, "
        f"{r.max_tokens} output tokens, KV payload {r.transfer_bytes / 1e6:.2f} MB",
        f"{'(ms)':<34}{'p50':>10}{'p99':>10}{'mean':>10}",
        row("engine alone, end to end", r.engine_ms),
        row("service path, end to end", r.service_ms),
        row("added by the service path", r.added_ms),
        row("  of which KV transfer", r.transfer_ms),
        row("  overhead beyond the transfer", r.overhead_ms),
        row("engine alone, first token", r.engine_ttft_ms),
        row("service path, first token", r.service_ttft_ms),
        row("added to the first token", r.added_ttft_ms),
        row("bare gRPC round trip", r.grpc_rtt_ms),
        row("bare Redis round trip", r.redis_rtt_ms),
        f"floor of the service path on this machine: {len(CRITICAL_PATH)} gRPC and "
        f"{CRITICAL_PATH_REDIS} Redis round trips in sequence = {r.floor_ms:.2f} ms",
        f"  ({'; '.join(CRITICAL_PATH)})",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the demo model)")
    p.add_argument("--preset", default="small", help="demo preset when --model is absent")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None, help="torch threads per engine")
    args = p.parse_args(list(argv))
    # Before torch loads: this process's idle OpenMP threads must not spin on the cores the
    # cluster's workers are using (the launcher sets the same for them).
    from pdserve.compute.omp import adopt_worker_wait_policy

    adopt_worker_wait_policy()
    from pdserve.launcher import default_model

    model = args.model or default_model(args.preset)
    result = measure(
        model,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        requests=args.requests,
        dtype=args.dtype,
        threads=args.threads,
    )
    print(format_result(result))
    return 0
