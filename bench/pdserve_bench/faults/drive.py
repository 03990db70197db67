"""One fault under load: arrivals before and after the kill, every answer checked, then the
census of what the cluster still holds.

Clients behave as a careful user's would: a request refused or unreachable before its first
token is tried again (jittered backoff, up to 0.5 s), one whose stream broke after tokens is
started over (the router that carried it died); both only within the request's deadline. A
request counts as

* ``ok``: its tokens are the engine's, exactly;
* ``wrong``: it finished with other tokens (a token lost or repeated on the way);
* ``lost``: its deadline passed first, or it failed for good.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.launcher import Cluster
from pdserve.supervisor import REDIS
from pdserve_bench.faults.leaks import Holdings, holdings
from pdserve_bench.faults.scenarios import Scenario
from pdserve_bench.serve.openai import OpenAITarget
from pdserve_bench.serve.targets import RejectedError, RouterTarget, Target, TargetError

POLL_S = 0.1
"""Polling the census of other processes: nothing to wait on."""


@dataclass(frozen=True, slots=True)
class Job:
    prompt: list[int]
    expected: list[int]
    send_at_s: float


@dataclass(slots=True)
class Outcome:
    sent_s: float
    ttft_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    restarts: int = 0
    """Times the client started the request over after its stream broke."""
    retries: int = 0
    """Times it was tried again before any token."""
    error: str | None = None


@dataclass(frozen=True, slots=True)
class FaultResult:
    scenario: str
    victim: str
    killed_at_s: float
    sent: int
    ok: int
    wrong: int
    lost: int
    restarts: int
    retries: int
    ttft_p99_before_s: float | None
    ttft_p99_window_s: float | None
    victim_restarts: int
    left: Holdings
    clean_after_s: float | None
    """Seconds from the last answer until the cluster held nothing (None: never, in time)."""
    errors: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["left"] = self.left.to_json()
        return out


async def serve_one(target: Target, job: Job, start: float, deadline_s: float) -> Outcome:
    """``job`` through ``target`` as the module docstring says; times from ``start``."""
    sent = time.monotonic()
    out = Outcome(sent - start)
    backoff = 0.05
    while True:
        out.tokens, first = [], None
        try:
            async for chunk in target.stream(job.prompt, len(job.expected)):
                if chunk.token_ids:
                    first = first if first is not None else time.monotonic() - sent
                    out.tokens += chunk.token_ids
            out.ttft_s = first
            return out
        except (TargetError, RejectedError) as e:
            if time.monotonic() - sent > deadline_s:
                out.error = str(e).splitlines()[0]
                return out
            if out.tokens:
                out.restarts += 1
            else:
                out.retries += 1
            await asyncio.sleep(random.uniform(0, backoff))  # retry backoff, jittered
            backoff = min(0.5, backoff * 2)


def _p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    return (
        statistics.quantiles(values, n=100, method="inclusive")[98]
        if len(values) > 1
        else values[0]
    )


def kill(c: Cluster, victim: str) -> int:
    """SIGKILL the victim (no shutdown of any kind); its pid."""
    if victim == REDIS:
        redis = c.embedded_redis
        assert redis is not None and redis.pid is not None
        pid = redis.pid
    else:
        proc = next(s.proc for s in c.services if s.name == victim)
        assert proc is not None
        pid = proc.pid
    os.kill(pid, signal.SIGKILL)
    return pid


def target_of(s: Scenario, c: Cluster) -> Target:
    if s.http:
        return OpenAITarget(c.http_url, s.name)
    return RouterTarget(",".join(c.router_addresses), s.name)


async def run(s: Scenario, c: Cluster, jobs: Sequence[Job], *, kill_at_s: float,
              deadline_s: float, settle_s: float = 60.0) -> FaultResult:  # fmt: skip
    """Send ``jobs`` on their schedule, kill the victim at ``kill_at_s``, check every answer,
    then wait (up to ``settle_s``) for the cluster to hold nothing."""
    target = target_of(s, c)
    await target.open()
    start = time.monotonic()
    tasks: list[asyncio.Task[Outcome]] = []
    dead: set[int] = set()
    try:
        killed = False
        for job in jobs:
            now = time.monotonic() - start
            if not killed and job.send_at_s >= kill_at_s:
                await asyncio.sleep(max(0.0, kill_at_s - now))  # the kill's moment
                dead.add(kill(c, s.victim))
                killed = True
                now = time.monotonic() - start
            await asyncio.sleep(max(0.0, job.send_at_s - now))  # the arrival's moment
            tasks.append(asyncio.create_task(serve_one(target, job, start, deadline_s)))
        outcomes = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await target.close()
    done_at = time.monotonic()
    left = await holdings(c, dead_pids=dead if s.victim != REDIS else set())
    while not left.clean and time.monotonic() - done_at < settle_s:
        await asyncio.sleep(POLL_S)
        left = await holdings(c, dead_pids=dead if s.victim != REDIS else set())
    clean_after = time.monotonic() - done_at if left.clean else None
    return _result(s, c, jobs, outcomes, kill_at_s, left, clean_after)


def _result(
    s: Scenario,
    c: Cluster,
    jobs: Sequence[Job],
    outcomes: Sequence[Outcome],
    kill_at_s: float,
    left: Holdings,
    clean_after: float | None,
) -> FaultResult:
    ok = sum(
        o.error is None and o.tokens == j.expected for j, o in zip(jobs, outcomes, strict=True)
    )
    lost = sum(o.error is not None for o in outcomes)
    before = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.sent_s < kill_at_s]
    window = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.sent_s >= kill_at_s]
    assert c.supervisor is not None
    return FaultResult(
        scenario=s.name,
        victim=s.victim,
        killed_at_s=kill_at_s,
        sent=len(outcomes),
        ok=ok,
        wrong=len(outcomes) - ok - lost,
        lost=lost,
        restarts=sum(o.restarts for o in outcomes),
        retries=sum(o.retries for o in outcomes),
        ttft_p99_before_s=_p99(before),
        ttft_p99_window_s=_p99(window),
        victim_restarts=c.supervisor.restarts(s.victim),
        left=left,
        clean_after_s=clean_after,
        errors=tuple(sorted({o.error for o in outcomes if o.error is not None}))[:5],
    )
