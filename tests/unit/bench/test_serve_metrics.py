"""`bench serve` statistics from synthetic records, checked against numpy computed here."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve_bench.serve.metrics import Slo, is_good, summarize
from pdserve_bench.serve.records import RequestRecord, Status


def synthetic(seed: int, n: int = 400, warmup: int = 6) -> list[RequestRecord]:
    """Records of every outcome; gaps mostly short, some requests with a long stall."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        send = float(rng.uniform(0, 60))
        rec = RequestRecord(i, "short", i < warmup, send - float(rng.uniform(0, 0.01)), 0)
        rec.send_s = send
        outcome = rng.choice(["ok", "ok", "ok", "ok", "rejected", "error", "error_late"])
        chunks = int(rng.integers(1, 40))
        ttft = float(rng.exponential(1.5))
        gaps = rng.exponential(0.03, chunks - 1)
        gaps[rng.random(chunks - 1) < 0.02] += 0.4  # stalls: some requests miss the ITL SLO
        times = send + ttft + np.concatenate([[0.0], np.cumsum(gaps)])
        tokens = rng.integers(1, 3, chunks).tolist()
        if outcome == "rejected":
            rec.status, rec.end_s = Status.REJECTED, send + 0.001
        elif outcome == "error":  # refused without being taken on (never reached)
            rec.status, rec.end_s = Status.ERROR, send + 0.002
        else:
            rec.chunk_s = times.tolist()
            rec.chunk_tokens = tokens
            rec.max_tokens = sum(tokens)
            rec.end_s = float(times[-1] + rng.uniform(0, 0.01))
            rec.admitted = True
            if outcome == "error_late":  # admitted, then cut short
                rec.status, rec.max_tokens = Status.ERROR, rec.max_tokens + 5
            else:
                rec.status, rec.error = Status.OK, ""
        out.append(rec)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_summary_matches_an_independent_computation(seed: int) -> None:
    records = synthetic(seed)
    slo = Slo(ttft_s=2.0, itl_s=0.1)
    s = summarize(records, slo)

    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.status is Status.OK]
    ttft = np.array([r.chunk_s[0] - r.send_s for r in ok])
    e2e = np.array([r.end_s - r.send_s for r in ok])
    itl = np.concatenate([np.diff(r.chunk_s) for r in ok])
    tpot = np.array(
        [
            (r.end_s - r.chunk_s[0]) / (sum(r.chunk_tokens) - 1)
            for r in ok
            if sum(r.chunk_tokens) > 1
        ]
    )
    for stats, values in ((s.ttft, ttft), (s.e2e, e2e), (s.itl, itl), (s.tpot, tpot)):
        assert stats is not None and stats.n == len(values)
        assert stats.mean == pytest.approx(values.mean())
        for q in (50, 90, 99):
            assert getattr(stats, f"p{q}") == pytest.approx(np.percentile(values, q))

    def good(r: RequestRecord) -> bool:
        if r.status is not Status.OK or r.chunk_s[0] - r.send_s > 2.0:
            return False
        gaps = np.diff(r.chunk_s)
        return len(gaps) == 0 or np.percentile(gaps, 99) <= 0.1

    n_good = sum(good(r) for r in measured)
    assert 0 < n_good < len(ok)  # the SLOs bite: the check is not vacuous
    assert s.sent == len(measured)
    assert s.good == n_good and s.goodput == pytest.approx(n_good / len(measured))
    assert s.ok == len(ok)
    assert s.rejected == sum(r.status is Status.REJECTED for r in measured)
    assert s.errors == sum(r.status is Status.ERROR for r in measured)
    assert s.admitted_failed == sum(r.status is Status.ERROR and r.admitted for r in measured)
    assert 0 < s.admitted_failed < s.errors
    assert s.rejected_share == pytest.approx(s.rejected / len(measured))
    span = max(r.end_s for r in measured) - min(r.send_s for r in measured)
    assert s.throughput_tok_s == pytest.approx(sum(sum(r.chunk_tokens) for r in ok) / span)
    lag = np.array([r.send_s - r.scheduled_s for r in measured])
    assert s.send_lag is not None and s.send_lag.p99 == pytest.approx(np.percentile(lag, 99))


def test_goodput_edges() -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.0625)  # binary fractions: exact sums
    one_chunk = RequestRecord(
        0,
        "x",
        False,
        0.0,
        1,
        send_s=0.0,
        chunk_s=[0.5],
        chunk_tokens=[1],
        end_s=0.5,
        status=Status.OK,
        error="",
    )
    assert is_good(one_chunk, slo)  # no gap to miss
    at_slo = RequestRecord(
        1,
        "x",
        False,
        0.0,
        2,
        send_s=0.0,
        chunk_s=[1.0, 1.0625],
        chunk_tokens=[1, 1],
        end_s=1.0625,
        status=Status.OK,
        error="",
    )
    assert is_good(at_slo, slo)  # bounds are inclusive
    late = RequestRecord(
        2,
        "x",
        False,
        0.0,
        1,
        send_s=0.0,
        chunk_s=[1.01],
        chunk_tokens=[1],
        end_s=1.01,
        status=Status.OK,
        error="",
    )
    assert not is_good(late, slo)
    rejected = RequestRecord(3, "x", False, 0.0, 1, send_s=0.0, status=Status.REJECTED)
    assert not is_good(rejected, slo)
    s = summarize([one_chunk, rejected], slo)
    assert s.goodput == 0.5 and s.itl is None and s.tpot is None


def test_empty_point() -> None:
    s = summarize([], Slo())
    assert s.sent == 0 and s.goodput == 0.0 and s.ttft is None and s.throughput_tok_s is None


def test_classes_and_prefix_hit_rate() -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.5)

    def done(i: int, kind: str, ttft: float, prompt: int, cached: int | None) -> RequestRecord:
        return RequestRecord(
            i, kind, False, 0.0, 1, prompt_tokens=prompt, send_s=0.0, chunk_s=[ttft],
            chunk_tokens=[1], end_s=ttft, status=Status.OK, error="", cached_tokens=cached,
        )  # fmt: skip

    records = [
        done(0, "long", 2.0, 1000, 600),  # late
        done(1, "long", 0.5, 1000, 0),
        done(2, "short", 0.25, 100, 50),
        done(3, "short", 0.5, 100, None),  # its target did not say: left out of the hit rate
        RequestRecord(4, "short", False, 0.0, 1, send_s=0.0, status=Status.REJECTED),
    ]
    s = summarize(records, slo)
    assert s.classes is not None and set(s.classes) == {"long", "short"}
    long, short = s.classes["long"], s.classes["short"]
    assert (long.sent, long.good, short.sent, short.good) == (2, 1, 3, 2)
    assert short.ttft is not None and short.ttft.n == 2 and short.ttft.p50 == pytest.approx(0.375)
    assert s.prefix_hit_rate == pytest.approx(650 / 2100)
    assert s.to_json()["classes"]["long"]["goodput"] == 0.5
    assert summarize([done(9, "x", 0.1, 10, None)], slo).prefix_hit_rate is None
