"""What one measurement point sends, and when: the plan of an open-loop run.

A ``Load`` (mix or trace, seed, size, arrival process) turns into a ``PointPlan`` per offered
rate. Three seeded random streams keep the points comparable and reproducible:

* *shapes* (request class, prompt and output lengths, conversation turns): the seed only, so
  every rate sends the same sequence of request shapes;
* *arrivals* (unit exponential gaps, divided by the rate): the seed only, so a higher rate is
  the same arrival pattern compressed;
* *tokens* (prompt token ids in ``[FIRST_PROMPT_ID, vocab)``): the seed and the rate, so no
  two points share a prompt (a prefix cache cannot carry one point into the next) while every
  target measured at a point gets the same token ids (targets with ``--features`` other
  tokens of the same shapes, the same for every server: ``Load.plan``'s ``salt``).

A trace line may say what its prompt shares with others (``block_hashes``, ``block_size``,
as ``pdserve trace capture`` writes them): its leading blocks are then the token blocks of
those hashes, made from the same seed and rate (``prefixes``), so the replayed prompts share
exactly the leading blocks the captured ones did, and only the rest is the request's own.
A line's ``tenant`` is read and kept, not sent: a ``Target`` streams a prompt without one.

Arrival processes: Poisson (the default), bursts of ``N`` requests every ``N / rate`` seconds
(``burst=N``), everything at ``t = 0`` (``burst=0``), or a trace's own arrival times, scaled
to a mean rate when one is given.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve.trace_file import PromptPrefix, TraceEntry, trace_rate
from pdserve_bench.measure import make_prompts
from pdserve_bench.serve.mixes import Mix
from pdserve_bench.serve.prefixes import BlockTokens


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a point, before it is sent."""

    index: int
    arrival_s: float
    """When to send it, in seconds from the point's start."""
    prompt: tuple[int, ...]
    """The prompt's token ids; for a conversation's turn, only its new user tokens (the
    history the target produced is put in front when the turn is sent)."""
    output_tokens: int
    """``max_tokens``; sent with ``ignore_eos``, so exactly this many are expected back."""
    kind: str
    """The request class (``long``, ``short``, ...), ``turn`` or ``trace``."""
    session: int | None = None
    turn: int = 0
    """1, 2, ... within ``session``; 0 for independent requests."""
    warmup: bool = False
    """Sent like the rest, kept in the records, left out of every statistic."""


@dataclass(frozen=True, slots=True)
class PointPlan:
    """Every request of one point, in arrival order."""

    rate: float | None
    """Offered load in requests/s; None for one burst of everything, or a trace at its own
    pace."""
    requests: tuple[PlannedRequest, ...]

    @property
    def measured(self) -> int:
        return sum(not r.warmup for r in self.requests)


@dataclass(frozen=True, slots=True)
class _Shape:
    prompt_tokens: int
    output_tokens: int
    kind: str
    session: int | None = None
    turn: int = 0
    prefix: PromptPrefix | None = None
    """A trace line's captured leading blocks (None: the whole prompt is the request's own)."""


@dataclass(frozen=True, slots=True)
class Load:
    """What to send at every point: a mix or a trace, how many, and how they arrive."""

    vocab_size: int
    mix: Mix | None = None
    trace: tuple[TraceEntry, ...] | None = None
    seed: int = 0
    num_requests: int | None = None
    """Measured requests per point (warm-up ones come on top)."""
    duration_s: float | None = None
    """Or: measured requests are those arriving within this long after the warm-up."""
    warmup: int = 0
    burst: int | None = None
    """None: Poisson; 0: every request at t=0; N: bursts of N every N / rate seconds."""

    def __post_init__(self) -> None:
        if (self.mix is None) == (self.trace is None):
            raise InvalidArgumentError("load", "give a mix or a trace")
        if self.vocab_size <= 16:
            raise InvalidArgumentError("vocab_size", f"must exceed 16, got {self.vocab_size}")
        if self.num_requests is not None and self.num_requests < 1:
            raise InvalidArgumentError("num_requests", "must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise InvalidArgumentError("duration", "must be > 0")
        if self.trace is None and (self.num_requests is None) == (self.duration_s is None):
            raise InvalidArgumentError("load", "give a number of requests or a duration")
        if self.warmup < 0:
            raise InvalidArgumentError("warmup", "must be >= 0")
        if self.burst is not None and self.burst < 0:
            raise InvalidArgumentError("burst", "must be >= 0")
        if self.burst == 0 and self.duration_s is not None:
            raise InvalidArgumentError("duration", "one burst of everything needs --num-requests")
        if self.trace is not None and self.burst is not None:
            raise InvalidArgumentError("burst", "a trace brings its own arrival times")

    def plan(self, rate: float | None, *, salt: str = "") -> PointPlan:
        """The point at ``rate`` requests/s (None: burst of everything, or the trace as is).
        ``salt`` (a target's features) draws other prompt tokens of the same shapes, so one
        server measured plain and with features never sees a prompt twice (its prefix cache
        would serve the second), while every server gets the same tokens per features."""
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise InvalidArgumentError("rate", f"must be a positive number, got {rate}")
        if rate is None and self.trace is None and self.burst != 0:
            raise InvalidArgumentError("rate", "Poisson arrivals and bursts of N need a rate")
        key = ("none" if rate is None else f"{float(rate):.9g}") + (f":{salt}" if salt else "")
        token_rng = random.Random(f"{self.seed}:tokens:{key}")
        blocks = BlockTokens(self.vocab_size, f"{self.seed}:blocks:{key}")
        out: list[PlannedRequest] = []
        for i, (at, shape) in enumerate(self._timed_shapes(rate)):
            if shape.prefix is not None and shape.prefix.block_hashes:
                prompt = blocks.prompt(shape.prefix, shape.prompt_tokens, token_rng)
            else:
                prompt = make_prompts(token_rng, 1, shape.prompt_tokens, self.vocab_size)[0]
            out.append(
                PlannedRequest(
                    i, at, tuple(prompt), shape.output_tokens, shape.kind,
                    shape.session, shape.turn, warmup=i < self.warmup,
                )
            )  # fmt: skip
        return PointPlan(rate, tuple(out))

    def _timed_shapes(self, rate: float | None) -> Iterator[tuple[float, _Shape]]:
        """Arrival time and shape of every request of the point, warm-up ones first."""
        timed = zip(self._arrivals(rate), self._shapes(), strict=False)
        if self.num_requests is not None:
            yield from itertools.islice(timed, self.warmup + self.num_requests)
            return
        start = None
        for i, (at, shape) in enumerate(timed):
            if i == self.warmup:
                start = at
            if start is not None and self.duration_s is not None and at - start > self.duration_s:
                return
            yield at, shape

    def _arrivals(self, rate: float | None) -> Iterator[float]:
        if self.trace is not None:
            first, native = self.trace[0].arrival_s, trace_rate(self.trace)
            scale = native / rate if rate is not None and native is not None else 1.0
            yield from ((e.arrival_s - first) * scale for e in self.trace)
            return
        if self.burst == 0:
            yield from itertools.repeat(0.0)
            return
        assert rate is not None  # checked by plan()
        if self.burst is not None:
            yield from ((i // self.burst) * self.burst / rate for i in itertools.count())
            return
        gaps = random.Random(f"{self.seed}:arrivals")
        t = 0.0
        while True:
            yield t
            t += gaps.expovariate(1.0) / rate

    def _shapes(self) -> Iterator[_Shape]:
        rng = random.Random(f"{self.seed}:shapes")
        if self.trace is not None:
            yield from (
                _Shape(e.prompt_tokens, e.output_tokens, "trace", prefix=e.prefix)
                for e in self.trace
            )
            return
        assert self.mix is not None
        conv = self.mix.conversation
        if conv is None:
            while True:
                cls = self.mix.draw_class(rng)
                yield _Shape(cls.prompt.draw(rng), cls.output.draw(rng), cls.name)
        # Conversations: each arrival continues one of the open sessions, drawn uniformly.
        sessions = itertools.count()
        open_: list[list[int]] = []  # [session id, turns planned, turns sent]
        while True:
            while len(open_) < conv.open_sessions:
                open_.append([next(sessions), conv.turns.draw(rng), 0])
            pick = rng.randrange(len(open_))
            sid, turns, sent = open_[pick]
            user = (conv.first if sent == 0 else conv.user).draw(rng)
            yield _Shape(user, conv.output.draw(rng), "turn", sid, sent + 1)
            if sent + 1 == turns:
                open_.pop(pick)
            else:
                open_[pick][2] = sent + 1
