"""SLOs scaled to the machine, as DistServe's "SLO scale": measure each target alone, then ask
every target for K times the slowest one's isolated figures.

An absolute SLO set on one machine ranks nothing on another: where prefill runs a few times
slower, no configuration of anyone's meets it at any rate. So before the sweep each target
serves, one request at a time:

* ``REPS`` prompts of the mix's longest prompt class (its longest length), one output token
  each: the median time to the first token is its isolated TTFT;
* ``REPS`` prompts of the mix's shortest class (its shortest length) with ``ITL_TOKENS``
  output tokens: the median of the gaps between chunks is its isolated ITL p50.

SLO = K x the largest isolated TTFT and K x the largest isolated ITL over the targets, the
same for every target (so none is judged on its own slowness). Conversation mixes use their
first turn's range. Times are in the run's modelled seconds under a time scale.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve_bench.serve.metrics import Slo, summarize
from pdserve_bench.serve.mixes import Mix, Span
from pdserve_bench.serve.sweep import RunResult
from pdserve_bench.serve.targets import Target
from pdserve_bench.serve.timescale import REAL_TIME, TimeScale

REPS = 3
ITL_TOKENS = 32
FIRST_TOKEN = 16
"""Token ids are drawn from ``[FIRST_TOKEN, vocab)``, as the workload draws them."""


@dataclass(frozen=True, slots=True)
class Isolated:
    """One target alone: what the scaled SLOs are derived from."""

    label: str
    ttft_s: float
    itl_s: float
    long_prompt_tokens: int
    short_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ScaledSlo:
    """The SLO of a run and how it was derived."""

    scale: float
    slo: Slo
    isolated: tuple[Isolated, ...]

    def describe(self) -> str:
        slowest_ttft = max(self.isolated, key=lambda i: i.ttft_s)
        slowest_itl = max(self.isolated, key=lambda i: i.itl_s)
        return (
            f"SLO scale {self.scale:g}: TTFT <= {self.slo.ttft_s:.3g} s ({self.scale:g} x "
            f"{slowest_ttft.label}'s isolated {slowest_ttft.ttft_s:.3g} s for "
            f"{slowest_ttft.long_prompt_tokens} prompt tokens), gap <= "
            f"{self.slo.itl_s * 1e3:.3g} ms ({self.scale:g} x {slowest_itl.label}'s isolated "
            f"ITL p50 {slowest_itl.itl_s * 1e3:.3g} ms)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "ttft_s": self.slo.ttft_s,
            "itl_s": self.slo.itl_s,
            "isolated": [asdict(i) for i in self.isolated],
        }


def prompt_ranges(mix: Mix) -> tuple[Span, Span]:
    """The mix's longest and shortest prompt classes' ranges."""
    if mix.conversation is not None:
        return mix.conversation.first, mix.conversation.first
    spans = [c.prompt for c in mix.classes]
    return max(spans, key=lambda s: s.hi), min(spans, key=lambda s: s.lo)


async def measure(
    target: Target, mix: Mix, vocab_size: int, *, seed: int = 0, scale: TimeScale = REAL_TIME
) -> Isolated:
    """``target`` alone (module docstring); times in modelled seconds under ``scale``."""
    longest, shortest = prompt_ranges(mix)
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(n)]

    ttfts, gaps = [], []
    for _ in range(REPS):
        stamps = await _stamps(target, prompt(longest.hi), 1)
        ttfts.append(stamps[0][0])
    for _ in range(REPS):
        stamps = await _stamps(target, prompt(shortest.lo), ITL_TOKENS)
        # A chunk of k tokens spreads its gap over them, as the router's metrics do.
        gaps += [(b - a) / n for (a, _), (b, n) in itertools.pairwise(stamps) for _ in range(n)]
    if not gaps:
        why = "streamed each answer in one chunk: no gap to measure"
        raise InvalidArgumentError("--slo-scale", f"{target.label} {why}")
    factor = scale.factor
    return Isolated(
        target.label,
        statistics.median(ttfts) / factor,
        statistics.median(gaps) / factor,
        longest.hi,
        shortest.lo,
    )


def scaled(scale: float, isolated: Sequence[Isolated]) -> ScaledSlo:
    """The SLO ``scale`` times the slowest target's isolated figures."""
    if not scale > 0:
        raise InvalidArgumentError("--slo-scale", f"must be > 0, got {scale}")
    slo = Slo(scale * max(i.ttft_s for i in isolated), scale * max(i.itl_s for i in isolated))
    return ScaledSlo(scale, slo, tuple(isolated))


async def _stamps(target: Target, prompt: list[int], max_tokens: int) -> list[tuple[float, int]]:
    """Seconds from sending to each chunk that carried tokens, and its tokens."""
    t0 = time.perf_counter()
    out = []
    async for chunk in target.stream(prompt, max_tokens):
        if chunk.tokens:
            out.append((time.perf_counter() - t0, chunk.tokens))
    if not out:
        raise InvalidArgumentError("--slo-scale", f"{target.label} returned no token")
    return out


def other_scales(result: RunResult, found: Sequence[ScaledSlo]) -> list[str]:
    """Report lines: each point's goodput under each further scaled SLO (the run's own SLO is
    the first; the records are the same, only the judgement changes)."""
    out = []
    for extra in found:
        out.append(extra.describe())
        for p in result.points:
            rate = "-" if p.rate is None else f"{p.rate:g}"
            goodput = summarize(p.records, extra.slo).goodput
            out.append(f"  {p.target} at {rate} req/s: goodput {goodput:.2f}")
    return out
