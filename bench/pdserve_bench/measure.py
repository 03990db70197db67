"""The measurement method shared by every engine under test.

Each engine is wrapped as a ``Peer`` whose only operation is "run these prompts to completion
with exactly ``max_tokens`` new tokens each and say how long it took". Everything else (the
prompts, warm-up, repeats, the prefill/decode split and the medians) lives here, so pdserve,
HF transformers and vLLM are timed by the same code:

* prefill of an ``L``-token prompt = wall time of ``generate([prompt], max_tokens=1)``
  (the prompt's forward pass plus one sampled token).
* decode at batch ``B`` = ``B * (N - 1) / (t_N - t_1)`` where ``t_N`` is the wall time of
  ``generate(B prompts, max_tokens=N)`` and ``t_1`` that of ``max_tokens=1`` on the same prompts:
  subtracting ``t_1`` removes the prefill and the first token, leaving ``N - 1`` decode steps.

Cases run interleaved (case by case, repeat by repeat, peer by peer) so that a change in machine
load during the run hits every peer alike and the ratios stay side by side.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.errors import InvalidArgumentError, PdServeError

FIRST_PROMPT_ID = 16
"""Prompt tokens are drawn from ``[FIRST_PROMPT_ID, vocab)``: clear of BOS/EOS/PAD and friends."""


class PeerError(PdServeError):
    """An engine under test failed, or did not generate what it was asked to."""


class Peer(Protocol):
    """One engine under test."""

    name: str

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        """Greedily generate exactly ``max_tokens`` tokens per prompt; return wall seconds."""
        ...

    def close(self) -> None:
        """Release the engine (memory, subprocesses)."""
        ...


@dataclass(frozen=True, slots=True)
class Workload:
    """What to measure. Defaults are the documented benchmark."""

    prefill_lens: tuple[int, ...] = (1024, 4096)
    """Prompt lengths timed for prefill (batch 1)."""
    decode_batches: tuple[int, ...] = (1, 8, 32)
    """Batch sizes timed for decode."""
    decode_prompt_len: int = 32
    """Prompt length of every decode sequence."""
    decode_tokens: int = 128
    """``N``: tokens generated per sequence in the long decode run."""
    repeats: int = 3
    """Timed repetitions per case and peer; the median is reported."""
    warmup_tokens: int = 16
    """Tokens per sequence in each decode case's warm-up run."""
    seed: int = 0
    max_spread: float = 0.25
    """A case whose samples on some peer spread wider than this ((max - min) / median) is
    repeated, a round at a time, up to ``max_repeats``: a point caught by a burst of load
    elsewhere is measured again instead of reported as it fell."""
    max_repeats: int = 0
    """Rounds a wide case may grow to (0: twice ``repeats``)."""

    def __post_init__(self) -> None:
        if not self.prefill_lens or min(self.prefill_lens) < 1:
            raise InvalidArgumentError("prefill_lens", "need at least one positive length")
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise InvalidArgumentError("decode_batches", "need at least one positive batch size")
        if self.decode_prompt_len < 1:
            raise InvalidArgumentError("decode_prompt_len", "must be >= 1")
        if self.decode_tokens < 2:
            raise InvalidArgumentError("decode_tokens", "must be >= 2 (decode = t_N - t_1)")
        if self.repeats < 1:
            raise InvalidArgumentError("repeats", "must be >= 1")
        if self.warmup_tokens < 1:
            raise InvalidArgumentError("warmup_tokens", "must be >= 1")
        if not self.max_spread > 0:
            raise InvalidArgumentError("max_spread", f"must be > 0, got {self.max_spread}")
        if self.max_repeats and self.max_repeats < self.repeats:
            raise InvalidArgumentError("max_repeats", "must be 0 or >= repeats")

    @property
    def repeat_cap(self) -> int:
        return self.max_repeats or 2 * self.repeats

    @property
    def max_context(self) -> int:
        """Longest prompt + output any case needs."""
        return max(max(self.prefill_lens) + 1, self.decode_prompt_len + self.decode_tokens)

    @property
    def max_batch(self) -> int:
        return max(self.decode_batches)

    def cases(self, vocab_size: int) -> list[Case]:
        """Every case in run order, with its prompts."""
        rng = random.Random(self.seed)
        out: list[Case] = []
        for n in self.prefill_lens:
            out.append(Case(f"prefill_{n}", "prefill", make_prompts(rng, 1, n, vocab_size), 1))
        for b in self.decode_batches:
            prompts = make_prompts(rng, b, self.decode_prompt_len, vocab_size)
            out.append(Case(f"decode_b{b}", "decode", prompts, self.decode_tokens))
        return out


def make_prompts(rng: random.Random, batch: int, length: int, vocab_size: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` pseudo-random token ids (all distinct prompts)."""
    if vocab_size <= FIRST_PROMPT_ID:
        raise InvalidArgumentError("vocab_size", f"must exceed {FIRST_PROMPT_ID}, got {vocab_size}")
    return [
        [rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(length)] for _ in range(batch)
    ]


@dataclass(frozen=True, slots=True)
class Case:
    """One measured configuration."""

    name: str
    kind: str
    """``prefill`` or ``decode``."""
    prompts: list[list[int]] = field(repr=False)
    max_tokens: int

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def prompt_len(self) -> int:
        return len(self.prompts[0])


@dataclass(slots=True)
class CaseResult:
    """One peer's samples for one case; the reported figures are medians."""

    case: str
    kind: str
    batch: int
    prompt_len: int
    seconds: list[float] = field(default_factory=list)
    """prefill: wall time of each repeat. decode: ``t_N - t_1`` of each repeat."""
    t1: list[float] = field(default_factory=list)
    """decode only: ``t_1`` of each repeat."""
    tokens: int = 0
    """Tokens one repeat's ``seconds`` accounts for: the prompt (prefill) or ``B * (N - 1)``."""

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """``(max - min) / median`` of the samples (0 for fewer than two)."""
        if len(self.seconds) < 2 or self.median_seconds <= 0:
            return 0.0
        return (max(self.seconds) - min(self.seconds)) / self.median_seconds

    @property
    def tokens_per_second(self) -> float | None:
        """Median over repeats of ``tokens / seconds``; None if every sample was non-positive."""
        rates = [self.tokens / s for s in self.seconds if s > 0]
        return statistics.median(rates) if rates else None

    def to_json(self) -> dict[str, object]:
        return {
            "case": self.case,
            "kind": self.kind,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "t1": self.t1,
            "median_seconds": self.median_seconds,
            "spread": self.spread,
            "tokens_per_second": self.tokens_per_second,
        }


def measure_once(peer: Peer, case: Case) -> tuple[float, float | None]:
    """One repeat: ``(seconds, t_1)``; see the module docstring for the method."""
    if case.kind == "prefill":
        return peer.generate(case.prompts, 1), None
    t1 = peer.generate(case.prompts, 1)
    tn = peer.generate(case.prompts, case.max_tokens)
    return tn - t1, t1


def warm_up(peer: Peer, case: Case, warmup_tokens: int) -> None:
    """Run the case's shapes once untimed (allocations, kernel selection, caches)."""
    peer.generate(
        case.prompts, 1 if case.kind == "prefill" else min(warmup_tokens, case.max_tokens)
    )


def run_cases(
    peers: Sequence[Peer],
    workload: Workload,
    vocab_size: int,
    log: Callable[[str], None] = lambda _msg: None,
) -> dict[str, dict[str, CaseResult]]:
    """Measure every case on every peer; returns ``{peer name: {case name: result}}``."""
    return run_case_list(
        peers, workload.cases(vocab_size), workload.repeats, workload.warmup_tokens, log,
        max_spread=workload.max_spread, max_repeats=workload.repeat_cap,
    )  # fmt: skip


def run_case_list(
    peers: Sequence[Peer],
    cases: Sequence[Case],
    repeats: int,
    warmup_tokens: int,
    log: Callable[[str], None] = lambda _msg: None,
    *,
    max_spread: float = math.inf,
    max_repeats: int = 0,
) -> dict[str, dict[str, CaseResult]]:
    """``run_cases`` over given cases: each warmed up on every peer, then ``repeats`` rounds
    of one repeat per peer (interleaved), and more rounds, up to ``max_repeats`` in all,
    while some peer's samples of the case spread wider than ``max_spread``."""
    results: dict[str, dict[str, CaseResult]] = {p.name: {} for p in peers}
    for case in cases:
        tokens = case.prompt_len if case.kind == "prefill" else case.batch * (case.max_tokens - 1)
        for peer in peers:
            results[peer.name][case.name] = CaseResult(
                case.name, case.kind, case.batch, case.prompt_len, tokens=tokens
            )
            warm_up(peer, case, warmup_tokens)
        mine = [results[p.name][case.name] for p in peers]
        r = 0
        while r < repeats or (r < max_repeats and max(x.spread for x in mine) > max_spread):
            if r == repeats:
                log(f"{case.name}: samples spread {max(x.spread for x in mine):.0%}, repeating")
            for peer in peers:
                seconds, t1 = measure_once(peer, case)
                res = results[peer.name][case.name]
                res.seconds.append(seconds)
                if t1 is not None:
                    res.t1.append(t1)
                log(f"{case.name} repeat {r + 1}/{repeats} {peer.name}: {seconds:.3f} s")
            r += 1
    return results
