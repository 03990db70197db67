"""`bench serve` workloads: deterministic per seed, within the mix's ranges and shares, and
arrivals with the rate's statistics. Tolerances come from the sample size (a z-score bound),
not from a fixed number."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import Counter
from pathlib import Path

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.trace_file import load_trace, trace_rate
from pdserve_bench.serve.mixes import (
    CHAT,
    LONG_PROMPT_HEAVY,
    MIXES,
    MULTI_TURN,
    SHORT_ONLY,
    Mix,
    RequestClass,
    Span,
    get_mix,
)
from pdserve_bench.serve.workload import Load

VOCAB = 32000
Z = 5.0
"""Bound in standard errors: a correct generator fails it with probability < 1e-6."""


def _load(mix: Mix = LONG_PROMPT_HEAVY, **kw: object) -> Load:
    args: dict[str, object] = {"vocab_size": VOCAB, "mix": mix, "num_requests": 200}
    args.update(kw)
    return Load(**args)  # type: ignore[arg-type]


def test_same_seed_same_plan_other_seed_other_plan() -> None:
    a = _load(seed=3).plan(4.0)
    assert a == _load(seed=3).plan(4.0)
    b = _load(seed=4).plan(4.0)
    assert [r.prompt for r in a.requests] != [r.prompt for r in b.requests]
    assert [r.arrival_s for r in a.requests] != [r.arrival_s for r in b.requests]


def test_rates_share_shapes_and_arrival_pattern_not_token_ids() -> None:
    """Every rate sends the same lengths, the same arrival pattern compressed, fresh ids."""
    slow, fast = _load().plan(2.0), _load().plan(8.0)
    assert [len(r.prompt) for r in slow.requests] == [len(r.prompt) for r in fast.requests]
    assert [r.output_tokens for r in slow.requests] == [r.output_tokens for r in fast.requests]
    for s, f in zip(slow.requests, fast.requests, strict=True):
        assert f.arrival_s == pytest.approx(s.arrival_s / 4)
    assert not {r.prompt for r in slow.requests} & {r.prompt for r in fast.requests}


@pytest.mark.parametrize("mix", [LONG_PROMPT_HEAVY, CHAT, SHORT_ONLY], ids=lambda m: m.name)
def test_lengths_within_each_class_and_shares_match(mix: Mix) -> None:
    n = 4000
    plan = _load(mix, num_requests=n, seed=1).plan(5.0)
    by_class = {c.name: c for c in mix.classes}
    counts = Counter(r.kind for r in plan.requests)
    for cls in mix.classes:
        p = cls.share
        tolerance = Z * math.sqrt(p * (1 - p) / n)
        assert abs(counts[cls.name] / n - p) <= tolerance + 1e-12, cls.name
    for r in plan.requests:
        cls = by_class[r.kind]
        assert cls.prompt.lo <= len(r.prompt) <= cls.prompt.hi
        assert cls.output.lo <= r.output_tokens <= cls.output.hi
        assert all(16 <= t < VOCAB for t in r.prompt)
    # Uniform within the range: the mean of each length is the range's midpoint.
    for cls in mix.classes:
        lens = [len(r.prompt) for r in plan.requests if r.kind == cls.name]
        width = cls.prompt.hi - cls.prompt.lo + 1
        sd = math.sqrt((width**2 - 1) / 12)
        mid = (cls.prompt.lo + cls.prompt.hi) / 2
        assert abs(statistics.fmean(lens) - mid) <= Z * sd / math.sqrt(len(lens))


def test_long_prompt_heavy_is_the_issues_mix() -> None:
    long, short = LONG_PROMPT_HEAVY.classes
    assert (long.share, long.prompt, long.output) == (0.3, Span(1600, 2400), Span(8, 16))
    assert (short.share, short.prompt, short.output) == (0.7, Span(35, 110), Span(48, 96))
    assert set(MIXES) == {
        "long-prompt-heavy", "chat", "short-only", "prefill-heavy", "decode-heavy", "multi-turn"
    }  # fmt: skip


def test_the_planner_mixes_want_opposite_splits() -> None:
    # prefill-heavy: every prompt at least 187x its answer; decode-heavy: every answer longer
    # than its prompt (the planner's benchmark relies on that contrast).
    (doc,) = get_mix("prefill-heavy").classes
    (gen,) = get_mix("decode-heavy").classes
    assert doc.prompt.lo >= 187 * doc.output.hi
    assert gen.output.lo > gen.prompt.hi


def test_poisson_gaps_have_the_rate_as_mean_and_unit_coefficient_of_variation() -> None:
    n, rate = 5000, 6.0
    plan = _load(SHORT_ONLY, num_requests=n, seed=2).plan(rate)
    times = [r.arrival_s for r in plan.requests]
    assert times == sorted(times) and times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = 1 / rate  # an exponential's standard deviation equals its mean
    assert abs(statistics.fmean(gaps) - mean) <= Z * mean / math.sqrt(len(gaps))
    # Not evenly spaced: exponential gaps have coefficient of variation 1; the sample's has
    # a standard error of about 1 / sqrt(n) (the fourth moment of an exponential is 9 mean^4).
    cv = statistics.stdev(gaps) / statistics.fmean(gaps)
    assert abs(cv - 1.0) <= Z / math.sqrt(len(gaps))


def test_bursts_and_everything_at_once() -> None:
    plan = _load(SHORT_ONLY, num_requests=12, burst=4).plan(2.0)
    times = [r.arrival_s for r in plan.requests]
    assert times == [0.0] * 4 + [2.0] * 4 + [4.0] * 4  # 4 requests every 4 / 2 req/s
    once = _load(SHORT_ONLY, num_requests=7, burst=0).plan(None)
    assert [r.arrival_s for r in once.requests] == [0.0] * 7
    with pytest.raises(InvalidArgumentError, match="rate"):
        _load(SHORT_ONLY).plan(None)


def test_warmup_comes_first_and_on_top_of_the_measured_count() -> None:
    plan = _load(num_requests=10, warmup=3).plan(4.0)
    assert [r.warmup for r in plan.requests] == [True] * 3 + [False] * 10
    assert plan.measured == 10


def test_duration_counts_arrivals_after_the_warmup() -> None:
    plan = _load(num_requests=None, duration_s=30.0, warmup=2).plan(3.0)
    measured = [r for r in plan.requests if not r.warmup]
    start = measured[0].arrival_s
    assert all(r.arrival_s - start <= 30.0 for r in measured)
    # The next arrival, had there been one, would fall past the window: with 90 expected
    # arrivals, the count is within Z Poisson standard deviations of rate * duration.
    assert abs(len(measured) - 90) <= Z * math.sqrt(90)


def test_multi_turn_sessions_number_turns_in_order_and_stay_within_spans() -> None:
    conv = MULTI_TURN.conversation
    assert conv is not None
    plan = _load(MULTI_TURN, num_requests=600, seed=5).plan(4.0)
    seen: dict[int, int] = {}
    in_progress: set[int] = set()
    for r in plan.requests:
        assert r.session is not None and r.kind == "turn"
        assert r.turn == seen.get(r.session, 0) + 1  # turns in arrival order, none skipped
        seen[r.session] = r.turn
        span = conv.first if r.turn == 1 else conv.user
        assert span.lo <= len(r.prompt) <= span.hi
        assert conv.output.lo <= r.output_tokens <= conv.output.hi
        in_progress.add(r.session)
    assert max(seen.values()) <= conv.turns.hi
    # The first sessions, long finished after 600 arrivals, sent a whole conversation.
    assert all(conv.turns.lo <= seen[s] for s in range(10))
    assert len(in_progress) >= conv.open_sessions


def test_trace_replay_as_given_and_scaled(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [(10, 5, 1.0), (20, 6, 0.0), (30, 7, 3.0), (40, 8, 2.0)]
    path.write_text(
        "\n".join(json.dumps({"prompt_tokens": p, "output_tokens": o, "arrival_s": a})
                  for p, o, a in rows) + "\n\n"
    )  # fmt: skip
    trace = load_trace(path)
    assert [e.arrival_s for e in trace] == [0.0, 1.0, 2.0, 3.0]
    assert trace_rate(trace) == pytest.approx(1.0)
    load = Load(VOCAB, trace=trace)
    as_given = load.plan(None)
    assert [len(r.prompt) for r in as_given.requests] == [20, 10, 40, 30]
    assert [r.output_tokens for r in as_given.requests] == [6, 5, 8, 7]
    assert [r.arrival_s for r in as_given.requests] == [0.0, 1.0, 2.0, 3.0]
    fast = load.plan(4.0)
    assert [r.arrival_s for r in fast.requests] == pytest.approx([0.0, 0.25, 0.5, 0.75])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "expected an object"),
        ('{"prompt_tokens": 0, "output_tokens": 1, "arrival_s": 0}', "prompt_tokens"),
        ('{"prompt_tokens": 3, "output_tokens": true, "arrival_s": 0}', "output_tokens"),
        ('{"prompt_tokens": 3, "output_tokens": 2, "arrival_s": -1}', "arrival_s"),
        ('{"prompt_tokens": 3, "output_tokens": 2}', "arrival_s"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_tokens": 3, "output_tokens": 2, "arrival_s": 0}\n' + line + "\n")
    with pytest.raises(InvalidArgumentError, match=f"bad.jsonl:2: .*{message}"):
        load_trace(path)


def test_bad_mixes_and_loads_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="sum to 1"):
        Mix("x", "", (RequestClass("a", 0.5, Span(1, 2), Span(1, 2)),))
    with pytest.raises(InvalidArgumentError, match="unknown mix"):
        get_mix("nope")
    with pytest.raises(InvalidArgumentError, match="span"):
        Span(5, 4)
    with pytest.raises(InvalidArgumentError, match="vocab_size"):
        Load(16, mix=CHAT, num_requests=1)
    with pytest.raises(InvalidArgumentError, match="number of requests or a duration"):
        Load(VOCAB, mix=CHAT)
    with pytest.raises(InvalidArgumentError, match="rate"):
        _load().plan(-1.0)
