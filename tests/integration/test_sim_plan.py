"""``pdserve sim plan`` against real sim clusters: a tiny captured-style trace (12 requests,
three shared system prompts) under a loose SLO is held by the first configuration tried, one
``bench serve`` run on a cluster of two simulated H100s; the plan's table and JSON say so, and
the replay's shared prefixes reach the cluster's prefix cache.

The SLO is loose enough for any load on this machine; that no configuration meets an
impossible SLO is tested on synthetic outcomes (``tests/unit/sim/test_plan.py``), as it would
start every candidate up to the limit."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdserve.engine.block_manager import chain_block_hashes
from pdserve.models.demo import init_checkpoint
from pdserve.sim.cli import main_sim

pytestmark = pytest.mark.integration

REQUESTS, BLOCK = 12, 16


def _trace(path: Path) -> Path:
    """Twelve requests 0.1 s apart; request ``i`` starts with system prompt ``i % 3`` (three
    blocks), then 5-20 tokens of its own."""
    rng = random.Random(0)
    systems = [[rng.randrange(16, 500) for _ in range(3 * BLOCK)] for _ in range(3)]
    lines = []
    for i in range(REQUESTS):
        prompt = systems[i % 3] + [rng.randrange(16, 500) for _ in range(rng.randrange(5, 20))]
        hashes = chain_block_hashes(prompt[:-1], BLOCK, salt="")
        lines.append({
            "arrival_s": 0.1 * i, "prompt_tokens": len(prompt), "output_tokens": 3,
            "tenant": "", "block_size": BLOCK, "block_hashes": [h.hex() for h in hashes],
        })  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_loose_slo_is_met_by_the_smallest_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = init_checkpoint(tmp_path / "model", "tiny", dtype="float32")
    out = tmp_path / "plan.json"
    code = main_sim([
        "plan", "--trace", str(_trace(tmp_path / "trace.jsonl")), "--ttft-slo", "30",
        "--itl-slo", "30", "--max-workers", "3", "--mode", "conditional",
        "--model", str(model), "--json", str(out), "--log-dir", str(tmp_path / "logs"),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads(out.read_text())
    assert doc["requests"] == REQUESTS and doc["workers"] == [2, 3]
    (tried,) = doc["tried"]  # met at the first size: nothing larger started
    assert (tried["mode"], tried["prefill"], tried["decode"]) == ("conditional", 1, 1)
    assert tried["failure"] is None
    assert tried["sent"] == tried["good"] == REQUESTS and tried["goodput"] == 1.0
    assert tried["errors"] == tried["rejected"] == 0
    assert 0 < tried["ttft_p50_s"] <= tried["ttft_p99_s"] and tried["itl_p99_s"] > 0
    # Requests after the first of each system prompt found its blocks cached.
    assert tried["prefix_hit_rate"] > 0
    assert doc["chosen"] == tried
    assert "smallest meeting goodput 90%: conditional 1P+1M (2 workers" in printed
    assert (tmp_path / "logs" / "conditional-1p1" / "bench.json").is_file()
