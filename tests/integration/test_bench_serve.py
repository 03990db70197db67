"""`pdserve bench serve` against real tiny clusters it starts itself: the JSON accounts for
every request, consistently (structure, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.models.config import ModelConfig
from pdserve_bench.serve.cli import main
from pdserve_bench.serve.mixes import MULTI_TURN
from pdserve_bench.serve.workload import Load

REQUESTS, WARMUP, RATE, SEED = 8, 1, 8.0, 11


@pytest.mark.integration
def test_bench_serve_on_tiny_clusters(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    code = main(
        ["--config", "disaggregated", "--config", "colocated", "--label", "colo",
         "--model", str(tiny_llama_dir), "--dtype", "float32", "--threads", "1",
         "--colocated-workers", "1", "--mix", "multi-turn", "--seed", str(SEED),
         "--num-requests", str(REQUESTS), "--warmup", str(WARMUP), "--rates", str(RATE),
         "--json", str(out), "--quiet"]
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert [t["label"] for t in doc["targets"]] == ["pdserve-disaggregated-1p1d", "colo"]
    assert [t["cluster"]["mode"] for t in doc["targets"]] == ["disaggregated", "colocated"]
    vocab = ModelConfig.from_dir(tiny_llama_dir).vocab_size
    plan = Load(vocab, mix=MULTI_TURN, seed=SEED, num_requests=REQUESTS, warmup=WARMUP).plan(RATE)
    assert len(doc["points"]) == 2
    for point in doc["points"]:
        records = point["records"]
        # Every planned request is accounted for, once, and ended one way or another.
        assert [r["index"] for r in records] == list(range(REQUESTS + WARMUP))
        assert all(r["status"] in ("ok", "rejected", "error") for r in records)
        assert all(r["send_s"] is not None and r["end_s"] is not None for r in records)
        summary = point["summary"]
        assert summary["sent"] == REQUESTS
        assert summary["ok"] + summary["rejected"] + summary["errors"] == REQUESTS
        assert summary["admitted_failed"] == 0 and summary["errors"] == 0
        last: dict[int, dict[str, int]] = {}
        for rec, req in zip(records, plan.requests, strict=True):
            assert rec["warmup"] == req.warmup and rec["max_tokens"] == req.output_tokens
            assert rec["status"] == "ok", rec["error"]
            assert rec["send_s"] >= rec["scheduled_s"]
            assert 0 < rec["ttft_s"] <= rec["e2e_s"]
            assert rec["chunk_s"] == sorted(rec["chunk_s"])
            assert rec["send_s"] < rec["chunk_s"][0] and rec["chunk_s"][-1] <= rec["end_s"]
            assert sum(rec["chunk_tokens"]) == rec["output_tokens"] == req.output_tokens
            assert rec["reported_tokens"] == req.output_tokens
            # A later turn carries the history: previous prompt + its answer + new tokens.
            session = req.session
            assert session is not None and rec["session"] == session
            prev = last.get(session)
            expected = len(req.prompt) + (prev["prompt"] + prev["output"] if prev else 0)
            assert rec["prompt_tokens"] == expected
            last[session] = {"prompt": rec["prompt_tokens"], "output": rec["output_tokens"]}
