"""Paired bandwidth rounds of ``pdserve bench transfer``: every hand-off between two
measurements of its reference.

On a shared virtual machine the references move 2-4x within minutes (loopback TCP from 1.0 to
4.1 GB/s within one run here). A ratio against the run's best reference compares a transport
caught at a slow moment with the machine at its fastest; against one reference taken a minute
earlier, it compares the transport with a different machine. So each hand-off is bracketed:
its reference (memcpy for ``shm``, loopback TCP and raw gRPC for ``store`` and ``direct``) is
measured right before and right after it, its ratio is its rate over the mean of the two, and
a point's ratio is the median over ``--rounds`` rounds (default 9), reported with its range.
The CPU time of every service process is read right before and after each hand-off, and a
point's CPU seconds per GB are the median of its rounds': the whole hand-off on both
sides (the prefill's one-token step and the decode's one step included, the same for every
transport; the services' heartbeats and timers too, small beside it).

The hand-offs are deferred (every layer at hand, so the rate is the pipeline's, not the
compute's) and their prompt is served from the deferred prefill worker's prefix cache: a round
costs seconds, not a prefill's minutes. The prefill worker still gathers and moves the whole
prompt's KV (the decode worker is started with ``--no-decode-prefix``).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pdserve.telemetry.breakdown import percentile
from pdserve_bench.transfer_sample import Sample, link_bytes_per_s

Reference = Callable[[str], tuple[float, float]]
"""``reference(transport)``: (memcpy, 0) for shm, (loopback TCP, raw gRPC) otherwise, bytes/s.
Blocking (run in a thread)."""


@dataclass(frozen=True)
class Pair:
    """One deferred hand-off and its reference measured right before and right after it."""

    transport: str
    tokens: int
    num_bytes: int
    send_bytes_per_s: float
    recv_bytes_per_s: float
    before: float
    after: float
    """memcpy (shm) or loopback TCP, bytes/s."""
    grpc_before: float = 0.0
    grpc_after: float = 0.0
    """Raw gRPC, bytes/s (0: not measured, shm)."""
    cpu_s: float = -1.0
    """CPU seconds every service process spent during the hand-off (-1: not measured)."""
    latency_ms: float = -1.0
    """First byte sent to the KV checked (``Sample.latency_ms``; -1: not recorded)."""

    @classmethod
    def of(
        cls,
        x: Sample,
        before: tuple[float, float],
        after: tuple[float, float],
        cpu_s: float = -1.0,
    ) -> Pair:
        return cls(
            x.transport, x.tokens, x.num_bytes, x.send_span_bytes_per_s, x.recv_bytes_per_s,
            before[0], after[0], before[1], after[1], cpu_s, x.latency_ms,
        )  # fmt: skip

    @property
    def bytes_per_s(self) -> float:
        return link_bytes_per_s(self.transport, self.send_bytes_per_s, self.recv_bytes_per_s)

    @property
    def ratio(self) -> float:
        """Against the mean of the reference before and after."""
        return self.bytes_per_s / ((self.before + self.after) / 2)

    @property
    def grpc_ratio(self) -> float | None:
        grpc = (self.grpc_before + self.grpc_after) / 2
        return self.bytes_per_s / grpc if grpc > 0 else None


@dataclass(frozen=True)
class PairedPoint:
    """A (transport, size) point over its rounds: medians, and the range of the ratio."""

    transport: str
    tokens: int
    rounds: int
    send_bytes_per_s: float
    recv_bytes_per_s: float
    ratio: float
    ratio_low: float
    ratio_high: float
    grpc_ratio: float | None
    cpu_s_per_gb: float | None = None
    """The median over the rounds of the services' CPU seconds per GB moved (None: not
    measured)."""
    latency_ms: tuple[float, float] | None = None
    """p50 and p99 over the rounds of a hand-off's latency, one at a time (None: none)."""

    @property
    def ratio_text(self) -> str:
        return f"{self.ratio:.0%} ({self.ratio_low:.0%}-{self.ratio_high:.0%})"


def summarize(pairs: Sequence[Pair]) -> dict[tuple[str, int], PairedPoint]:
    """Per (transport, tokens): the medians of its rounds."""
    points = {}
    for key in dict.fromkeys((p.transport, p.tokens) for p in pairs):
        mine = [p for p in pairs if (p.transport, p.tokens) == key]
        ratios = [p.ratio for p in mine]
        grpc = [r for p in mine if (r := p.grpc_ratio) is not None]
        per_gb = [p.cpu_s / (p.num_bytes / 1e9) for p in mine if p.cpu_s >= 0 and p.num_bytes]
        latency = [p.latency_ms for p in mine if p.latency_ms >= 0]
        points[key] = PairedPoint(
            key[0], key[1], len(mine),
            statistics.median(p.send_bytes_per_s for p in mine),
            statistics.median(p.recv_bytes_per_s for p in mine),
            statistics.median(ratios), min(ratios), max(ratios),
            statistics.median(grpc) if grpc else None,
            statistics.median(per_gb) if per_gb else None,
            (percentile(latency, 50), percentile(latency, 99)) if latency else None,
        )  # fmt: skip
    return points


async def rounds(
    hand_off: Callable[[str], Awaitable[Sample]],
    transports: Sequence[str],
    n_rounds: int,
    reference: Reference,
    log: Callable[[str], None] = lambda _: None,
    cpu: Callable[[], float] | None = None,
) -> list[Pair]:
    """``n_rounds`` rounds of one ``hand_off(transport)`` per transport, each bracketed by
    ``reference(transport)`` (in a thread: the references run their own event loops);
    ``cpu()``: the services' CPU seconds so far, read right before and after each hand-off."""
    pairs = []
    for r in range(n_rounds):
        for t in transports:
            before = await asyncio.to_thread(reference, t)
            cpu_start = cpu() if cpu is not None else 0.0
            sample = await hand_off(t)
            cpu_s = cpu() - cpu_start if cpu is not None else -1.0
            after = await asyncio.to_thread(reference, t)
            pair = Pair.of(sample, before, after, cpu_s)
            pairs.append(pair)
            log(
                f"  round {r + 1}/{n_rounds} {t:6s} {sample.tokens:6d} tokens "
                f"{pair.bytes_per_s / 1e9:6.2f} GB/s against {pair.before / 1e9:.2f} / "
                f"{pair.after / 1e9:.2f} GB/s: {pair.ratio:.0%}"
            )
    return pairs
