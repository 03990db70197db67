"""``pdserve bench transfer`` end to end on the tiny checkpoint: it starts its services, moves
KV over every transport, and reports every point (the numbers themselves are not checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.transfer.nixl.agent import nixl_available
from pdserve_bench.transfer import main
from pdserve_bench.transfer_paired import Pair, summarize
from pdserve_bench.transfer_sample import Sample

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_bench_transfer_reports_every_transport(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "transfer.json"
    args = ["--model", str(tiny_llama_dir), "--tokens", "40", "--burst", "2",
            "--burst-tokens", "24", "--reference-mib", "8", "--json", str(out),
            "--repeats", "1", "--cheap-repeats", "2", "--rounds", "2",
            "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    assert main(args) == 0
    report = capsys.readouterr().out
    saved = json.loads(out.read_text())
    points = {(x["transport"], x["layerwise"]) for x in saved["samples"]}
    assert points == {
        *((t, lw) for t in ("shm", "store", "direct") for lw in (True, False)),
        ("recompute", True),
    }
    assert all(x["num_bytes"] > 0 for x in saved["samples"] if x["transport"] != "recompute")
    # A 40-token prompt is cheap: two runs a point, the least visible kept, the first beside.
    moved = [Sample(**x) for x in saved["samples"] if x["transport"] != "recompute"]
    assert all(0 <= x.visible_ms <= x.first_visible_ms for x in moved)
    assert "| shm | 40 | " in report.split("First hand-off of each size")[1]
    assert set(saved["bursts"]) == {f"{t}, {m}" for t in ("shm", "store", "direct")
                                    for m in ("layer-wise", "deferred")}  # fmt: skip
    refs = saved["references"]
    assert refs["memcpy"] > 0 and refs["tcp"] > 0 and refs["grpc"] > 0
    # Two paired rounds of every moving transport, each hand-off between two references.
    pairs = [Pair(**x) for x in saved["pairs"]]
    assert sorted((p.transport, p.tokens) for p in pairs) == sorted(
        (t, 40) for t in ("shm", "store", "direct") for _ in range(2)
    )
    for p in pairs:
        assert p.num_bytes > 0 and p.before > 0 and p.after > 0 and p.ratio > 0
        assert (p.grpc_ratio is None) == (p.transport == "shm")
        assert p.cpu_s >= 0  # the services' CPU read around each hand-off
        assert p.latency_ms > 0
    ratios = summarize(pairs)
    assert f"| {ratios['store', 40].ratio_text} |" in report
    assert "| store | 40 | " in report.split("CPU s/GB | latency p50 / p99 ms")[1]
    assert all(b["latency_p99_ms"] >= b["latency_p50_ms"] > 0 for b in saved["bursts"].values())
    for t in ("shm", "store", "direct", "recompute"):
        assert f"| {t} | 40 |" in report
    assert main(["--from-json", str(out)]) == 0  # the report again, from the saved run
    assert capsys.readouterr().out.strip() == report.strip()


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pdserve[nixl])")
def test_bench_transfer_measures_nixl_beside_direct(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With nixl the benchmark adds Redis and a scheduler (the agents are found in the
    heartbeats; each sample is assigned its decode worker): direct still goes direct."""
    out = tmp_path / "transfer.json"
    args = ["--model", str(tiny_llama_dir), "--tokens", "40", "--transports", "nixl,direct",
            "--burst", "2", "--burst-tokens", "24", "--reference-mib", "8", "--json", str(out),
            "--repeats", "1", "--cheap-repeats", "1", "--rounds", "1",
            "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    assert main(args) == 0
    saved = json.loads(out.read_text())
    points = {(x["transport"], x["layerwise"]) for x in saved["samples"]}
    assert points == {(t, lw) for t in ("nixl", "direct") for lw in (True, False)}
    assert all(x["num_bytes"] > 0 and x["recv_bytes_per_s"] > 0 for x in saved["samples"]
               if x["transport"] == "nixl")  # fmt: skip
    assert "| nixl | 40 | " in capsys.readouterr().out
