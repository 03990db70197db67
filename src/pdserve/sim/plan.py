"""``pdserve sim plan``: the smallest cluster, and its P:D split, that would have held an SLO
for a captured trace.

The trace (``pdserve trace capture``, or any ``bench serve --trace`` file) is replayed at its
own arrival times against clusters of simulated accelerators, one candidate configuration at
a time, smallest first: for each total of workers ``N`` from ``--min-workers`` up, every
split ``P`` prefill + ``N - P`` decode (disaggregated) or mixed (conditional) workers,
``P = 1 .. N - 1``, and ``N`` mixed workers (colocated), in the order of ``--mode``. The first
total at which any candidate's goodput (the share of requests within both SLOs) reaches the
target ends the search; its best candidate is the answer (highest goodput, then lowest TTFT
p99, then lowest ITL p99, then the first tried). Larger totals are not tried: they would only
cost more to run.

Each candidate is measured by ``pdserve bench serve`` itself, as its own process (one sim
cluster started, the whole trace replayed once with no warm-up, the cluster stopped, its
``--json`` report read back), so the plan is judged by exactly the code and the numbers of
the serving benchmark. A process rather than a call because this package models
accelerators and stays clear of RPC and Redis (the import contracts): the benchmark's
targets and the cluster launcher speak both.

The search itself (``plan``) takes any ``Measure``, so it is tested on synthetic outcomes.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import deathsig
from pdserve.errors import InvalidArgumentError, PdServeError
from pdserve.sim.flags import DEFAULT_LINK, DEFAULT_PROFILE, sim_flags

MODES = ("conditional", "disaggregated", "colocated")
"""Cluster kinds a plan may try, in the default order."""
BENCH_JSON_VERSION = 1
"""The version of ``bench serve --json`` documents this module reads."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One cluster configuration."""

    mode: str
    """``conditional``, ``disaggregated`` or ``colocated``."""
    prefill: int
    """Prefill workers (0 when colocated)."""
    decode: int
    """Decode workers (disaggregated), else mixed ones."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError("mode", f"must be one of {MODES}, got {self.mode!r}")
        if self.decode < 1 or self.prefill < (0 if self.mode == "colocated" else 1):
            raise InvalidArgumentError("workers", f"no such {self.mode} cluster: {self}")
        if self.mode == "colocated" and self.prefill:
            raise InvalidArgumentError("workers", "a colocated cluster has no prefill workers")

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    @property
    def split(self) -> str:
        """``1P+2D``, ``1P+2M`` or ``3M``."""
        if self.mode == "colocated":
            return f"{self.decode}M"
        return f"{self.prefill}P+{self.decode}{'D' if self.mode == 'disaggregated' else 'M'}"

    def __str__(self) -> str:
        return f"{self.mode} {self.split}"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "prefill": self.prefill, "decode": self.decode,
                "workers": self.total}  # fmt: skip


def candidates(total: int, modes: Sequence[str] = MODES) -> list[Candidate]:
    """Every configuration of ``total`` workers, mode by mode in ``modes``' order, prefill
    workers ascending."""
    out: list[Candidate] = []
    for mode in modes:
        if mode == "colocated":
            out.append(Candidate(mode, 0, total))
        else:
            out += (Candidate(mode, p, total - p) for p in range(1, total))
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one candidate did with the trace (times in modelled seconds)."""

    candidate: Candidate
    sent: int
    good: int
    """Requests that completed within both SLOs."""
    rejected: int = 0
    errors: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    prefix_hit_rate: float | None = None
    """Prompt tokens served from the prefix cache over all prompt tokens."""
    failure: str | None = None
    """Why nothing was measured (the cluster went down), else None."""

    @property
    def goodput(self) -> float:
        return self.good / self.sent if self.sent else 0.0

    def meets(self, goal: float) -> bool:
        return self.failure is None and self.sent > 0 and self.goodput >= goal

    def to_json(self) -> dict[str, Any]:
        return {
            **self.candidate.to_json(), "sent": self.sent, "good": self.good,
            "goodput": self.goodput, "rejected": self.rejected, "errors": self.errors,
            "ttft_p50_s": self.ttft_p50_s, "ttft_p99_s": self.ttft_p99_s,
            "itl_p99_s": self.itl_p99_s, "prefix_hit_rate": self.prefix_hit_rate,
            "failure": self.failure,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class PlanResult:
    """Every candidate tried, in order, and the answer."""

    goal: float
    min_workers: int
    max_workers: int
    tried: tuple[Outcome, ...]
    chosen: Outcome | None
    """The smallest configuration meeting ``goal``; None: none up to ``max_workers`` did."""

    def to_json(self) -> dict[str, Any]:
        return {
            "goodput_target": self.goal,
            "workers": [self.min_workers, self.max_workers],
            "tried": [o.to_json() for o in self.tried],
            "chosen": None if self.chosen is None else self.chosen.to_json(),
        }


def choose(outcomes: Sequence[Outcome], goal: float) -> Outcome | None:
    """Among the outcomes meeting ``goal``, those with the fewest workers; of them the highest
    goodput, then the lowest TTFT p99, then the lowest ITL p99, then the first given."""
    meeting = [o for o in outcomes if o.meets(goal)]
    if not meeting:
        return None
    fewest = min(o.candidate.total for o in meeting)
    inf = float("inf")
    return min(
        (o for o in meeting if o.candidate.total == fewest),
        key=lambda o: (-o.goodput, _or(o.ttft_p99_s, inf), _or(o.itl_p99_s, inf)),
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


Measure = Callable[[Candidate], Outcome]
"""Runs the trace on one candidate."""


def plan(
    measure: Measure,
    *,
    goal: float,
    max_workers: int,
    min_workers: int = 2,
    modes: Sequence[str] = MODES,
    on_outcome: Callable[[Outcome], None] = lambda _o: None,
) -> PlanResult:
    """Try the candidates of each total from ``min_workers`` up (``candidates``), stopping
    after the first total at which one meets ``goal``; see the module docstring."""
    check_search(goal=goal, max_workers=max_workers, min_workers=min_workers, modes=modes)
    tried: list[Outcome] = []
    for total in range(min_workers, max_workers + 1):
        for c in candidates(total, modes):
            outcome = measure(c)
            tried.append(outcome)
            on_outcome(outcome)
        if any(o.meets(goal) for o in tried):
            break
    return PlanResult(goal, min_workers, max_workers, tuple(tried), choose(tried, goal))


def check_search(*, goal: float, max_workers: int, min_workers: int, modes: Sequence[str]) -> None:
    """Refuse a search that cannot run (``InvalidArgumentError`` names the flag)."""
    if not 0 < goal <= 1:
        raise InvalidArgumentError("--goodput", f"must be in (0, 1], got {goal}")
    if min_workers < 1:
        raise InvalidArgumentError("--min-workers", f"must be >= 1, got {min_workers}")
    if max_workers < min_workers:
        raise InvalidArgumentError(
            "--max-workers", f"must be >= --min-workers ({min_workers}), got {max_workers}"
        )
    if not modes or any(m not in MODES for m in modes):
        raise InvalidArgumentError("--mode", f"expected some of {MODES}, got {list(modes)}")


# -- the report ---------------------------------------------------------------------------------


def _time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def outcome_line(o: Outcome) -> str:
    """One candidate, as the progress log says it."""
    if o.failure is not None:
        return f"{o.candidate} ({o.candidate.total} workers): failed: {o.failure}"
    return (
        f"{o.candidate} ({o.candidate.total} workers): goodput {o.goodput:.1%}, "
        f"TTFT p99 {_time(o.ttft_p99_s)}, ITL p99 {_time(o.itl_p99_s)}"
    )


def format_plan(result: PlanResult) -> str:
    """The table of every candidate tried, and the answer."""
    head = ("workers", "mode", "split", "goodput", "TTFT p50", "TTFT p99", "ITL p99",
            "rejected", "errors", "prefix hits", "")  # fmt: skip
    rows = [head]
    for o in result.tried:
        hits = "-" if o.prefix_hit_rate is None else f"{o.prefix_hit_rate:.1%}"
        note = "failed" if o.failure is not None else "meets" if o.meets(result.goal) else ""
        note += " <- chosen" if o is result.chosen else ""
        rows.append((str(o.candidate.total), o.candidate.mode, o.candidate.split,
                     f"{o.goodput:.1%}", _time(o.ttft_p50_s), _time(o.ttft_p99_s),
                     _time(o.itl_p99_s), str(o.rejected), str(o.errors), hits, note))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]  # fmt: skip
    c = result.chosen
    if c is None:
        lines.append(
            f"none of {len(result.tried)} configurations up to {result.max_workers} workers "
            f"reached goodput {result.goal:.0%}"
        )
    else:
        lines.append(
            f"smallest meeting goodput {result.goal:.0%}: {c.candidate} "
            f"({c.candidate.total} workers, goodput {c.goodput:.1%})"
        )
    return "\n".join(lines) + "\n"


# -- measuring a candidate with `pdserve bench serve` -------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchRun:
    """How ``bench serve`` replays the trace on a candidate (SLOs and times in modelled
    seconds, as ``bench serve`` takes them with ``--sim-time-scale``)."""

    trace: Path
    ttft_slo_s: float
    itl_slo_s: float
    goal: float
    profile: str = DEFAULT_PROFILE
    time_scale: float = 1.0
    link: str = DEFAULT_LINK
    model: Path | None = None
    preset: str = "small"
    vocab_size: int | None = None
    seed: int = 0
    request_timeout_s: float = 300.0
    worker_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    """Keep each candidate's benchmark output and cluster logs here."""

    def argv(self, c: Candidate, json_out: Path, log_dir: Path | None = None) -> list[str]:
        """The ``pdserve`` command line measuring ``c`` into ``json_out``."""
        out = [
            "bench", "serve", "--config", c.mode, "--workers", f"{c.prefill}:{c.decode}",
            "--backend", "sim", *sim_flags(self.profile, self.time_scale, self.link),
            "--trace", str(self.trace), "--warmup", "0", "--seed", str(self.seed),
            "--ttft-slo", f"{self.ttft_slo_s!r}s", "--itl-slo", f"{self.itl_slo_s!r}s",
            "--goodput-target", repr(self.goal),
            "--request-timeout", f"{self.request_timeout_s!r}s",
            "--json", str(json_out), "--quiet",
        ]  # fmt: skip
        out += ["--model", str(self.model)] if self.model is not None else ["--preset", self.preset]
        if self.vocab_size is not None:
            out += ["--vocab-size", str(self.vocab_size)]
        if log_dir is not None:
            out += ["--log-dir", str(log_dir)]
        return out + [f"--worker-arg={a}" for a in self.worker_args]

    def measure(self, c: Candidate) -> Outcome:
        """Run ``bench serve`` on ``c`` (its cluster is stopped when this returns);
        ``PdServeError`` when it could not run."""
        name = f"{c.mode}-{c.prefill}p{c.decode}"
        with contextlib.ExitStack() as stack:
            if self.log_dir is not None:
                work = self.log_dir / name
                work.mkdir(parents=True, exist_ok=True)
            else:
                work = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-plan-"))
                )
            json_out, output = work / "bench.json", work / "bench.out"
            argv = self.argv(c, json_out, work / "clusters" if self.log_dir else None)
            code = _run([sys.executable, "-m", "pdserve.cli", *argv], output)
            if code != 0:
                tail = "\n".join(output.read_text(errors="replace").splitlines()[-15:])
                raise PdServeError(f"bench serve on {c} exited with status {code}:\n{tail}")
            return outcome_of(c, json.loads(json_out.read_text()))


def _run(argv: list[str], output: Path) -> int:
    """Run ``argv`` with its output in ``output``; its exit status. The child dies with this
    process; a Ctrl-C reaches it too (same process group), and it is given time to stop its
    cluster."""
    with output.open("wb") as out:
        proc = subprocess.Popen(
            deathsig.wrap(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            return proc.wait()
        except BaseException as e:
            if not isinstance(e, KeyboardInterrupt):
                proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise


def outcome_of(c: Candidate, doc: dict[str, Any]) -> Outcome:
    """The outcome of ``c`` from its ``bench serve --json`` document (one point)."""
    if doc.get("version") != BENCH_JSON_VERSION:
        raise PdServeError(f"bench serve wrote a version {doc.get('version')} report")
    points = doc.get("points") or []
    if not points:
        why = next(iter((doc.get("dropped") or {}).values()), "no point was measured")
        return Outcome(c, 0, 0, failure=str(why).splitlines()[0])
    s = points[0]["summary"]
    ttft, itl = s.get("ttft_s") or {}, s.get("itl_s") or {}
    return Outcome(
        c, int(s["sent"]), int(s["good"]), int(s["rejected"]), int(s["errors"]),
        ttft.get("p50"), ttft.get("p99"), itl.get("p99"), s.get("prefix_hit_rate"),
    )  # fmt: skip
