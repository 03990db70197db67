"""``pdserve bench control-plane``: how much request rate the router, the scheduler replicas
and Redis carry before scheduling adds more than a budget to each request.

The workers are simulated accelerators (``--backend sim``), modelling H100s serving
Llama-3-8B: with short requests they are never the bottleneck, so what limits the rate is
the control plane. For each cluster shape (workers, scheduler replicas, routers) it offers
rising Poisson rates of short requests spread over the routers, and reads every request's
trace (the span file): the time scheduling adds is the router's part before placement
(``router.mode_decision``: validation, tokenization, the rollout arm) plus the placement
(``scheduler.assign``: the call's travel, the decision and the Redis re-check, retries
included). The answer is the highest rate whose p99 of that sum stays within the budget.

It also streams long answers through the router and through the HTTP gateway and divides
the tokens by the CPU time each process spent (``/proc``): tokens per core-second, the
figure a deployment sizes by. The same for the schedulers: assignments per core-second.

All of it shares one machine with the load generator and every simulated worker; the
per-core figures are what carries over to a cluster, the absolute rates are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.sim.flags import DEFAULT_PROFILE
from pdserve.telemetry.breakdown import percentile
from pdserve.telemetry.spans import ATTR_REQUEST_ID, ROUTER_MODE_DECISION, SCHEDULER_ASSIGN
from pdserve_bench.engine_bench import load_average, machine_info
from pdserve_bench.proc_cpu import cpu_s
from pdserve_bench.serve.openai import sse_lines

SCHEDULING = (ROUTER_MODE_DECISION, SCHEDULER_ASSIGN)


@dataclass(frozen=True, slots=True)
class Point:
    """One offered rate on one cluster shape."""

    workers: int
    schedulers: int
    routers: int
    rate: float
    sent: int
    ok: int
    traced: int
    """Requests whose scheduling spans were all found."""
    p50_ms: float
    p99_ms: float
    scheduler_cpu_s: float
    router_cpu_s: float


@dataclass(frozen=True, slots=True)
class Throughput:
    """Streamed tokens per core-second of one process kind."""

    workers: int
    what: str
    tokens: int
    cpu_s: float

    @property
    def per_core_s(self) -> float:
        return self.tokens / self.cpu_s if self.cpu_s > 0 else 0.0


async def offer(
    routers: Sequence[str], rate: float, n: int, tag: str, seed: int, max_tokens: int = 2
) -> tuple[list[str], int]:
    """``n`` short requests, Poisson at ``rate``, in turn over ``routers``; their ids and how
    many completed."""
    from pdserve.client import AsyncClient, RetryPolicy

    rng = random.Random(seed)
    clients = [AsyncClient(a, timeout=60, retry=RetryPolicy(max_attempts=1)) for a in routers]
    ids = [f"{tag}-{i}" for i in range(n)]

    async def one(i: int, at: float) -> bool:
        await asyncio.sleep(max(0.0, at - time.monotonic()))  # the planned arrival
        prompt = [rng.randrange(16, 2000) for _ in range(32)]
        try:
            await clients[i % len(clients)].generate(
                prompt, max_tokens=max_tokens, ignore_eos=True, request_id=ids[i]
            )
        except Exception:  # counted as not ok; the benchmark reports it
            return False
        return True

    start, t, tasks = time.monotonic(), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tasks.append(asyncio.create_task(one(i, start + t)))
    ok = sum(await asyncio.gather(*tasks))
    for c in clients:
        await c.close()
    return ids, ok


def scheduling_ms(span_file: Path, ids: Sequence[str], wait_s: float = 30.0) -> list[float]:
    """Per request of ``ids``: router.mode_decision + scheduler.assign, in ms, once the span
    file holds both for every request (or ``wait_s`` passed: the ones found)."""
    from pdserve.telemetry.span_file import read_span_file

    wanted = set(ids)
    deadline = time.monotonic() + wait_s
    while True:
        by_trace: dict[str, dict[str, int]] = {}
        request_of: dict[str, str] = {}
        for s in read_span_file(span_file) if span_file.exists() else []:
            rid = s.attributes.get(ATTR_REQUEST_ID)
            if s.name == "router.request" and rid in wanted:
                request_of[s.trace_id] = str(rid)
            if s.name in SCHEDULING:
                stages = by_trace.setdefault(s.trace_id, {})
                stages[s.name] = stages.get(s.name, 0) + s.end_ns - s.start_ns
        done = [
            sum(by_trace[t].values()) / 1e6
            for t in request_of
            if t in by_trace and all(name in by_trace[t] for name in SCHEDULING)
        ]
        if len(done) >= len(wanted) or time.monotonic() > deadline:
            return done
        time.sleep(0.5)  # polling a file other processes append to


async def stream_tokens(address: str, n: int, max_tokens: int) -> int:
    """``n`` concurrent streams of ``max_tokens`` through a router; tokens received."""
    from pdserve.client import AsyncClient

    async with AsyncClient(address, timeout=300) as client:

        async def one(i: int) -> int:
            got = 0
            async for delta in client.stream([20 + i, 21, 22, 23], max_tokens=max_tokens,
                                             ignore_eos=True):  # fmt: skip
                got += len(delta.token_ids)
            return got

        return sum(await asyncio.gather(*(one(i) for i in range(n))))


async def stream_http(url: str, n: int, max_tokens: int) -> int:
    """The same through the gateway's streamed /v1/completions; tokens (events with text)."""
    import httpx

    async with httpx.AsyncClient(timeout=300) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> int:
            body = {"model": model, "prompt": [20 + i, 21, 22, 23], "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            got = 0
            async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for line in sse_lines(resp.aiter_text()):
                    if line.startswith("data: {"):
                        got += 1
            return got

        return sum(await asyncio.gather(*(one(i) for i in range(n))))


def measure_shape(
    model: Path, workers: int, schedulers: int, routers: int, args: argparse.Namespace,
    out: Path,
) -> tuple[list[Point], list[Throughput]]:  # fmt: skip
    from pdserve.launcher import Cluster, is_replica

    spans = out / f"spans-{workers}w-{schedulers}s-{routers}r.jsonl"
    points: list[Point] = []
    rates: list[Throughput] = []
    with Cluster(
        model, backend="sim", mode="disaggregated", num_prefill=workers // 2,
        num_decode=workers - workers // 2, num_schedulers=schedulers, num_routers=routers,
        worker_args=["--sim-profile", args.profile], log_level="WARNING", trace_file=spans,
        startup_timeout_s=900.0, http_port=0 if args.gateway else None,
    ) as cluster:  # fmt: skip
        pids = {
            kind: [s.proc.pid for s in cluster.services
                   if is_replica(s.name, kind) and s.proc is not None]
            for kind in ("scheduler", "router", "gateway")
        }  # fmt: skip
        over = 0
        for k, rate in enumerate(args.rates):
            before = (cpu_s(pids["scheduler"]), cpu_s(pids["router"]))
            tag = f"cp-{workers}-{schedulers}-{routers}-{k}"
            ids, ok = asyncio.run(offer(cluster.router_addresses, rate, args.requests, tag, seed=k))
            after = (cpu_s(pids["scheduler"]), cpu_s(pids["router"]))
            found = scheduling_ms(spans, ids)
            p = Point(
                workers, schedulers, routers, rate, len(ids), ok, len(found),
                round(percentile(found, 50), 2) if found else float("nan"),
                round(percentile(found, 99), 2) if found else float("nan"),
                round(after[0] - before[0], 2), round(after[1] - before[1], 2),
            )  # fmt: skip
            points.append(p)
            print(
                f"  {workers} workers, {schedulers} scheduler(s), {routers} router(s), "
                f"{rate:g} req/s: ok {ok}/{len(ids)}, traced {len(found)}, scheduling p50 "
                f"{p.p50_ms:.2f} ms p99 {p.p99_ms:.2f} ms; CPU s: schedulers "
                f"{p.scheduler_cpu_s:.2f}, routers {p.router_cpu_s:.2f}",
                flush=True,
            )
            over = over + 1 if not (p.p99_ms <= args.budget_ms and ok == len(ids)) else 0
            if over >= 2:  # two rates past the budget: the rest would be too
                break
        if routers == 1 and schedulers == 1:
            before_r = cpu_s(pids["router"])
            tokens = asyncio.run(stream_tokens(cluster.router_address, 32, args.stream_tokens))
            rates.append(Throughput(workers, "router", tokens, cpu_s(pids["router"]) - before_r))
            if args.gateway:
                before_g = cpu_s(pids["gateway"])
                tokens = asyncio.run(stream_http(cluster.http_url, 32, args.stream_tokens))
                used = cpu_s(pids["gateway"]) - before_g
                rates.append(Throughput(workers, "gateway", tokens, used))
            for t in rates:
                print(
                    f"  {t.what}: {t.tokens} tokens streamed in {t.cpu_s:.2f} CPU s: "
                    f"{t.per_core_s:,.0f} tokens/s per core",
                    flush=True,
                )
    return points, rates


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench control-plane", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--workers", default="32,64", help="cluster sizes, comma-separated")
    p.add_argument("--schedulers", default="1,2,4", help="scheduler replicas to try")
    p.add_argument("--routers", default="1,2", help="routers to try")
    p.add_argument("--shapes", help="W:S:R,... (workers:schedulers:routers) instead of every "
                   "combination of --workers, --schedulers and --routers")  # fmt: skip
    p.add_argument("--rates", default="10,20,40,60,80,120,160",
                   type=lambda v: [float(x) for x in v.split(",")],
                   help="offered rates (req/s), ascending")  # fmt: skip
    p.add_argument("--requests", type=int, default=300, help="requests a point")
    p.add_argument("--budget-ms", type=float, default=10.0, help="p99 scheduling budget")
    p.add_argument("--stream-tokens", type=int, default=512, help="tokens per stream")
    p.add_argument("--no-gateway", dest="gateway", action="store_false")
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the tiny demo model)")
    p.add_argument("--out", type=Path, default=Path("control-plane"), help="spans and JSON")
    args = p.parse_args(list(argv))
    from pdserve.launcher import default_model

    model = args.model or default_model("tiny")
    args.out.mkdir(parents=True, exist_ok=True)
    machine = {**machine_info(), "load_1min": load_average()}
    print(f"machine: {json.dumps(machine)}", flush=True)
    points: list[Point] = []
    rates: list[Throughput] = []
    if args.shapes:
        shapes = [tuple(int(v) for v in x.split(":")) for x in args.shapes.split(",")]
    else:
        shapes = [
            (int(w), int(s), int(r))
            for w in args.workers.split(",")
            for s in args.schedulers.split(",")
            for r in args.routers.split(",")
        ]
    for w, s, r in shapes:
        print(f"{w} sim workers, {s} scheduler replica(s), {r} router(s):", flush=True)
        got, thr = measure_shape(model, w, s, r, args, args.out)
        points += got
        rates += thr
    print(f"\nhighest rate with scheduling p99 <= {args.budget_ms:g} ms and every request ok:")
    for shape in sorted({(x.workers, x.schedulers, x.routers) for x in points}):
        good = [x.rate for x in points if (x.workers, x.schedulers, x.routers) == shape
                and x.p99_ms <= args.budget_ms and x.ok == x.sent]  # fmt: skip
        # Per core at the busiest point: the schedulers' fixed background work (heartbeats,
        # the KV event stream) weighs least there.
        top = max(
            (x for x in points if (x.workers, x.schedulers, x.routers) == shape),
            key=lambda x: x.rate,
        )
        per_core = top.ok / max(1e-9, top.scheduler_cpu_s)
        print(
            f"  {shape[0]} workers, {shape[1]} scheduler(s), {shape[2]} router(s): "
            f"{max(good) if good else 'none'} req/s; {per_core:,.0f} assignments per "
            f"scheduler core-second at {top.rate:g} req/s"
        )
    (args.out / "control-plane.json").write_text(json.dumps({
        "machine": machine,
        "points": [asdict(x) for x in points],
        "throughput": [{**asdict(t), "per_core_s": t.per_core_s} for t in rates],
    }, indent=2))  # fmt: skip
    return 0
