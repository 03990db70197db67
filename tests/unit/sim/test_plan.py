"""``pdserve sim plan`` without clusters: the candidates and their order, the search stopping
at the first total where a configuration meets the target, the choice among those, the
report, the ``bench serve`` command line each candidate runs (checked against bench serve's
own parser) and the reading of its JSON, and the command on synthetic outcomes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.errors import InvalidArgumentError, PdServeError
from pdserve.sim.cli import main_sim
from pdserve.sim.plan import (
    DEFAULT_LINK,
    DEFAULT_PROFILE,
    BenchRun,
    Candidate,
    Outcome,
    candidates,
    choose,
    format_plan,
    outcome_of,
    plan,
)

GOAL = 0.9


def _ok(c: Candidate, goodput: float = 1.0, ttft: float = 0.1, itl: float = 0.01) -> Outcome:
    return Outcome(c, 100, round(goodput * 100), ttft_p50_s=ttft / 2, ttft_p99_s=ttft,
                   itl_p99_s=itl)  # fmt: skip


def test_candidates_in_order() -> None:
    assert [str(c) for c in candidates(2)] == [
        "conditional 1P+1M", "disaggregated 1P+1D", "colocated 2M",
    ]  # fmt: skip
    assert [str(c) for c in candidates(4, ("disaggregated", "colocated"))] == [
        "disaggregated 1P+3D", "disaggregated 2P+2D", "disaggregated 3P+1D", "colocated 4M",
    ]  # fmt: skip
    assert [str(c) for c in candidates(1)] == ["colocated 1M"]
    assert all(c.total == 5 for c in candidates(5))
    assert len(candidates(5)) == 4 + 4 + 1


@pytest.mark.parametrize(
    ("mode", "prefill", "decode"),
    [("disaggregated", 0, 2), ("conditional", 1, 0), ("colocated", 1, 2), ("mixed", 1, 1)],
)
def test_no_such_cluster(mode: str, prefill: int, decode: int) -> None:
    with pytest.raises(InvalidArgumentError):
        Candidate(mode, prefill, decode)


def _fake(results: dict[str, Outcome | float]) -> tuple[Callable[[Candidate], Outcome], list[str]]:
    """A measure answering from ``results`` (by candidate name; a float is a goodput; absent:
    goodput 0) and the list of candidates it was asked, in order."""
    asked: list[str] = []

    def measure(c: Candidate) -> Outcome:
        asked.append(str(c))
        found = results.get(str(c), 0.0)
        return found if isinstance(found, Outcome) else _ok(c, found)

    return measure, asked


def test_search_stops_after_the_first_size_meeting_the_target() -> None:
    measure, asked = _fake({"disaggregated 2P+1D": 0.95, "conditional 1P+2M": 0.92})
    result = plan(measure, goal=GOAL, max_workers=6)
    # Every candidate of sizes 2 and 3 (all of size 3, though the first meeting came early),
    # nothing larger.
    assert asked == [str(c) for n in (2, 3) for c in candidates(n)]
    assert [str(o.candidate) for o in result.tried] == asked
    assert result.chosen is not None and str(result.chosen.candidate) == "disaggregated 2P+1D"
    text = format_plan(result)
    assert "smallest meeting goodput 90%: disaggregated 2P+1D (3 workers" in text
    assert text.count("<- chosen") == 1 and text.count("meets") == 2


def test_none_up_to_the_limit() -> None:
    measure, asked = _fake({"colocated 5M": 1.0})  # beyond the limit: never tried
    result = plan(measure, goal=GOAL, max_workers=4, min_workers=3, modes=("colocated",))
    assert asked == ["colocated 3M", "colocated 4M"]
    assert result.chosen is None
    assert "none of 2 configurations up to 4 workers reached goodput 90%" in format_plan(result)
    assert result.to_json()["chosen"] is None and len(result.to_json()["tried"]) == 2


def test_choice_among_the_smallest() -> None:
    a, b, c, d = candidates(3)[:4]
    small = Candidate("colocated", 0, 2)
    outcomes = [
        _ok(small, 0.5),
        _ok(a, 0.95, ttft=0.2),
        _ok(b, 0.95, ttft=0.1, itl=0.02),
        _ok(c, 0.95, ttft=0.1, itl=0.01),
        Outcome(d, 0, 0, failure="worker exited"),
        _ok(Candidate("colocated", 0, 4), 1.0),
    ]
    assert choose(outcomes, GOAL) == outcomes[3]  # same goodput: lower TTFT, then lower ITL
    assert choose([*outcomes, _ok(small, 0.9)], GOAL) == _ok(small, 0.9)  # fewer workers win
    assert choose(outcomes[:1], GOAL) is None
    assert not outcomes[4].meets(0.0)


def test_bad_searches_are_refused() -> None:
    measure, asked = _fake({})
    for kw, flag in (
        ({"goal": 0.0}, "--goodput"),
        ({"goal": 1.5}, "--goodput"),
        ({"min_workers": 0}, "--min-workers"),
        ({"max_workers": 1}, "--max-workers"),
        ({"modes": ("mixed",)}, "--mode"),
        ({"modes": ()}, "--mode"),
    ):
        args: dict[str, Any] = {"goal": GOAL, "max_workers": 3, **kw}
        with pytest.raises(InvalidArgumentError, match=flag):
            plan(measure, **args)
    assert asked == []


def test_defaults_are_those_of_bench_serve_and_the_sim_worker() -> None:
    from pdserve_bench.serve.cli_targets import DEFAULT_SIM_LINK, DEFAULT_SIM_PROFILE

    assert (DEFAULT_PROFILE, DEFAULT_LINK) == (DEFAULT_SIM_PROFILE, DEFAULT_SIM_LINK)


def test_each_candidate_is_a_bench_serve_command_line(tmp_path: Path) -> None:
    from pdserve_bench.serve.cli import parser
    from pdserve_bench.serve.cli_targets import cluster_spec
    from pdserve_bench.serve.settings import settings

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_tokens": 5, "output_tokens": 2, "arrival_s": 0}\n')
    run = BenchRun(trace, 0.25, 0.03, 0.8, time_scale=4.0, model=tmp_path, vocab_size=300,
                   seed=7, worker_args=("--max-num-seqs=8",))  # fmt: skip
    for c in (Candidate("conditional", 2, 1), Candidate("colocated", 0, 3)):
        argv = run.argv(c, tmp_path / "out.json", tmp_path / "logs")
        assert argv[:2] == ["bench", "serve"]
        args = parser().parse_args(argv[2:])
        spec = cluster_spec(args, args.targets[0].value, args.targets[0])
        assert (spec.mode, spec.backend, spec.decode) == (c.mode, "sim", c.decode)
        assert c.mode == "colocated" or spec.prefill == c.prefill
        assert "--sim-time-scale=4.0" in spec.worker_args
        assert "--max-num-seqs=8" in spec.worker_args
        s = settings(args)
        assert (s.slo.ttft_s, s.slo.itl_s, s.time_scale.factor) == (0.25, 0.03, 4.0)
        assert (s.rates, s.load.warmup, s.load.seed, s.load.vocab_size) == ([None], 0, 7, 300)
        assert (args.json, args.log_dir, args.quiet) == (tmp_path / "out.json",
                                                         tmp_path / "logs", True)  # fmt: skip


def _bench_doc(summary: dict[str, Any] | None, dropped: dict[str, str] | None = None) -> Any:
    points = [] if summary is None else [{"target": "x", "summary": summary}]
    return {"version": 1, "points": points, "dropped": dropped or {}}


def test_reading_the_bench_report() -> None:
    c = Candidate("disaggregated", 1, 1)
    doc = _bench_doc({
        "sent": 12, "good": 11, "rejected": 1, "errors": 0, "prefix_hit_rate": 0.4,
        "ttft_s": {"p50": 0.01, "p99": 0.02}, "itl_s": {"p50": 0.005, "p99": 0.008},
    })  # fmt: skip
    assert outcome_of(c, doc) == Outcome(c, 12, 11, 1, 0, 0.01, 0.02, 0.008, 0.4)
    nothing = _bench_doc({"sent": 3, "good": 0, "rejected": 3, "errors": 0,
                          "ttft_s": None, "itl_s": None})  # fmt: skip
    assert outcome_of(c, nothing) == Outcome(c, 3, 0, 3, 0)
    down = outcome_of(c, _bench_doc(None, {"x": "prefill-0 exited; last lines:\n..."}))
    assert down.failure == "prefill-0 exited; last lines:" and not down.meets(0.1)
    with pytest.raises(PdServeError, match="version 2"):
        outcome_of(c, {**doc, "version": 2})


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_tokens": 5, "output_tokens": 2, "arrival_s": 0}\n'
                    '{"prompt_tokens": 9, "output_tokens": 2, "arrival_s": 0.5}\n')  # fmt: skip
    return path


@pytest.mark.parametrize("meets", [True, False])
def test_the_command_on_synthetic_outcomes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    meets: bool,
) -> None:  # fmt: skip
    asked: list[Candidate] = []

    def measure(self: BenchRun, c: Candidate) -> Outcome:
        assert (self.ttft_slo_s, self.itl_slo_s, self.goal) == (0.5, 0.05, 0.8)
        asked.append(c)
        return _ok(c, 1.0 if meets and c.total == 3 and c.mode == "colocated" else 0.5)

    monkeypatch.setattr(BenchRun, "measure", measure)
    out = tmp_path / "plan.json"
    code = main_sim(["plan", "--trace", str(_trace(tmp_path)), "--ttft-slo", "500ms",
                     "--itl-slo", "0.05", "--goodput", "0.8", "--max-workers", "3",
                     "--mode", "disaggregated", "colocated", "--json", str(out)])  # fmt: skip
    assert code == (0 if meets else 1)
    assert [str(c) for c in asked] == [
        "disaggregated 1P+1D", "colocated 2M",
        "disaggregated 1P+2D", "disaggregated 2P+1D", "colocated 3M",
    ]  # fmt: skip
    printed = capsys.readouterr()
    assert "trace of 2 requests" in printed.out
    assert printed.err.count("goodput") == len(asked)  # one progress line per candidate
    doc = json.loads(out.read_text())
    assert [t["mode"] for t in doc["tried"]] == [c.mode for c in asked]
    assert doc["slo"] == {"ttft_s": 0.5, "itl_s": 0.05} and doc["goodput_target"] == 0.8
    if meets:
        assert "smallest meeting goodput 80%: colocated 3M (3 workers" in printed.out
        assert doc["chosen"]["mode"] == "colocated" and doc["chosen"]["workers"] == 3
    else:
        assert "none of 5 configurations up to 3 workers" in printed.out
        assert doc["chosen"] is None


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--sim-profile", "roofline:h100:nope"], "--sim-profile"),
        (["--sim-time-scale", "0"], "--sim-time-scale"),
        (["--max-workers", "1"], "--max-workers"),
        (["--vocab-size", "10"], "--vocab-size"),
        (["--json", "/no/such/dir/plan.json"], "--json"),
    ],
)
def test_refused_before_any_cluster_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], flag: str
) -> None:
    monkeypatch.setattr(BenchRun, "measure", lambda *_: pytest.fail("measured"))
    with pytest.raises(InvalidArgumentError, match=flag):
        main_sim(["plan", "--trace", str(_trace(tmp_path)), "--ttft-slo", "1",
                  "--itl-slo", "1", *argv])  # fmt: skip


def test_a_malformed_trace_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_tokens": 5, "output_tokens": 2, "arrival_s": 0, "block_size": 0}\n')
    with pytest.raises(InvalidArgumentError, match="block_size"):
        main_sim(["plan", "--trace", str(bad), "--ttft-slo", "1", "--itl-slo", "1"])
