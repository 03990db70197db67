"""`pdserve bench overhead` runs end to end (a smoke test: structure, not speed)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

from pdserve_bench.overhead import (
    CRITICAL_PATH,
    CRITICAL_PATH_REDIS,
    ROUND_TRIPS,
    format_result,
    measure,
)


@pytest.mark.integration
def test_overhead_bench_runs_on_tiny(tiny_llama_dir: Path) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    r = measure(
        tiny_llama_dir, prompt_tokens=40, max_tokens=4, requests=2, dtype="float32", threads=1
    )
    assert len(r.service_ms) == len(r.engine_ms) == len(r.service_ttft_ms) == 2
    assert all(t > 0 for t in r.transfer_ms) and r.transfer_bytes > 0
    assert all(0 < f <= e for f, e in zip(r.service_ttft_ms, r.service_ms, strict=True))
    assert len(r.grpc_rtt_ms) == len(r.redis_rtt_ms) == ROUND_TRIPS
    assert all(t > 0 for t in (*r.grpc_rtt_ms, *r.redis_rtt_ms))
    # The floor counts every critical-path call once, at its kind's median.
    grpc, redis = statistics.median(r.grpc_rtt_ms), statistics.median(r.redis_rtt_ms)
    assert r.floor_ms == pytest.approx(len(CRITICAL_PATH) * grpc + CRITICAL_PATH_REDIS * redis)
    text = format_result(r)
    for label in (
        "added by the service path",
        "of which KV transfer",
        "added to the first token",
        "bare gRPC round trip",
        f"= {r.floor_ms:.2f} ms",
    ):
        assert label in text
