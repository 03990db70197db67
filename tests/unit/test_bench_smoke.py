"""Smoke tests of ``pdserve bench engine`` and ``bench attention`` on the tiny preset:
structure, not speed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.cli import main as cli_main
from pdserve.errors import InvalidArgumentError
from pdserve.models import cpu_attention
from pdserve.models.demo import parameter_count
from pdserve_bench.attention_bench import AttentionWorkload
from pdserve_bench.measure import Case, Workload, run_cases


class FakePeer:
    """A peer whose wall time is a known function of the work: 0.5 s + 10 ms per token."""

    name = "pdserve"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        self.calls.append((len(prompts), len(prompts[0]), max_tokens))
        return 0.5 + 0.01 * len(prompts) * max_tokens

    def close(self) -> None:
        pass


def test_method_splits_decode_from_prefill() -> None:
    """decode = B * (N - 1) / (t_N - t_1): the fixed 0.5 s and the first token cancel."""
    workload = Workload(
        prefill_lens=(10,),
        decode_batches=(1, 4),
        decode_prompt_len=5,
        decode_tokens=9,
        repeats=3,
        warmup_tokens=4,
    )
    peer = FakePeer()
    results = run_cases([peer], workload, vocab_size=100)["pdserve"]

    assert results["decode_b1"].tokens_per_second == pytest.approx(100.0)
    assert results["decode_b4"].tokens_per_second == pytest.approx(100.0)
    assert results["prefill_10"].median_seconds == pytest.approx(0.51)  # one call, max_tokens=1
    assert results["prefill_10"].tokens_per_second == pytest.approx(10 / 0.51)
    # Per case: one warm-up, then per repeat one call (prefill) or t_1 and t_N (decode).
    assert peer.calls.count((1, 10, 1)) == 1 + 3
    assert peer.calls.count((4, 5, 9)) == 3
    assert peer.calls.count((4, 5, 1)) == 3
    assert peer.calls.count((4, 5, 4)) == 1  # the warm-up


def test_prompts_are_deterministic_and_in_range() -> None:
    cases_a = Workload(decode_batches=(2,), prefill_lens=(7,)).cases(vocab_size=50)
    cases_b = Workload(decode_batches=(2,), prefill_lens=(7,)).cases(vocab_size=50)
    assert [c.prompts for c in cases_a] == [c.prompts for c in cases_b]
    ids = [t for c in cases_a for p in c.prompts for t in p]
    assert all(16 <= t < 50 for t in ids)
    decode: Case = cases_a[1]
    assert decode.batch == 2 and decode.prompts[0] != decode.prompts[1]


def test_workload_rejects_bad_sizes() -> None:
    with pytest.raises(InvalidArgumentError, match="decode_tokens"):
        Workload(decode_tokens=1)  # t_N - t_1 needs N >= 2
    with pytest.raises(InvalidArgumentError, match="repeats"):
        Workload(repeats=0)


def test_vllm_peer_needs_an_interpreter(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from pdserve_bench.vllm_peer import VllmPeer

    with pytest.raises(InvalidArgumentError, match="vllm_python"):
        VllmPeer(tmp_path / "no-python", tiny_llama_dir, Workload(), dtype="float32", threads=1)


def test_bench_engine_cli_on_tiny_checkpoint(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "engine",
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--prefill-lens",
        "64",
        "--decode-batches",
        "1,2",
        "--decode-prompt-len",
        "16",
        "--decode-tokens",
        "32",
        "--repeats",
        "3",
        "--max-repeats",  # the round count is asserted: no repeats for a wide spread
        "3",
        "--membw-mib",
        "16",
        "--prefill-chunk",  # also pdserve with a 16-token budget: the 64-token prompt in 4
        "16",
        "--json",
        str(out),
        "--quiet",
    ]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())

    expected_rows = {
        "prefill_64_s",
        "prefill_64_tok_s",
        "decode_b1_tok_s",
        "decode_b2_tok_s",
        "decode_b1_roofline_frac",
    }
    assert set(report["metrics"]) == expected_rows
    for key in expected_rows:
        row = report["metrics"][key]
        for peer in ("pdserve", "hf"):
            assert row[peer] is not None and row[peer] > 0, (key, peer, row)
        assert row["vllm"] is None and row["pdserve_over_vllm"] is None
        assert row["pdserve_over_hf"] == pytest.approx(row["pdserve"] / row["hf"])
        assert row["pdserve_chunked"] is not None and row["pdserve_chunked"] > 0, key
        ratio = row["chunked_over_one_shot"]
        assert ratio == pytest.approx(row["pdserve_chunked"] / row["pdserve"])
    assert "vllm" in report["skipped"]

    # Per case and peer: every repeat kept; a prefill's token count is its prompt.
    cases = report["cases"]["pdserve"]
    assert len(cases["decode_b2"]["seconds"]) == 3 and len(cases["decode_b2"]["t1"]) == 3
    assert cases["prefill_64"]["tokens"] == 64
    assert cases["decode_b2"]["tokens"] == 2 * 31

    bw, roof = report["bandwidth"], report["roofline"]
    assert bw["read_gbps"] > 0 and bw["copy_gbps"] > 0
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert roof["weight_bytes_total"] == 4 * parameter_count(cfg)  # float32
    assert roof["weight_bytes_read"] == 4 * (
        parameter_count(cfg) - (cfg["vocab_size"] - 1) * cfg["hidden_size"]
    )
    assert math.isclose(
        roof["tokens_per_second"],
        bw["read_gbps"]
        * 1e9
        / (roof["weight_bytes_read"] + roof["kv_bytes_per_token"] * (16 + 32 / 2)),
    )

    table = capsys.readouterr().out
    for label in ("prefill 64 tok", "decode batch 1", "decode batch 2", "decode b1 / roofline"):
        assert label in table
    assert "pdserve chunked" in table and "chunked/one-shot" in table


@pytest.mark.skipif(not cpu_attention.NATIVE_MODULE, reason="native attention kernels not built")
def test_bench_attention_cli_on_tiny_checkpoint(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pdserve bench attention`` times both engines on every case and prints the ratios."""
    out = tmp_path / "attention.json"
    argv = [
        "bench", "attention", "--model", str(tiny_llama_dir), "--dtype", "float32",
        "--threads", "1", "--prefill-lens", "40", "--decode-batches", "2",
        "--short-prompt-len", "8", "--long-prompt-len", "50", "--decode-tokens", "4",
        "--repeats", "2", "--json", str(out),
    ]  # fmt: skip
    assert cli_main(argv) == 0
    doc = json.loads(out.read_text())
    cases = ["prefill 40", "decode b2 short", "decode b2 mixed"]
    for peer in ("torch", "native"):
        assert list(doc["results"][peer]) == cases
        for case in cases:
            assert len(doc["results"][peer][case]["seconds"]) == 2
    assert doc["results"]["native"]["decode b2 mixed"]["prompt_len"] == 50
    printed = capsys.readouterr().out
    assert all(case in printed for case in cases) and "speedup" in printed


def test_attention_workload_cases() -> None:
    w = AttentionWorkload(prefill_lens=(64,), decode_batches=(1, 3), long_prompt_len=100)
    cases = w.cases(vocab_size=500)
    assert [c.name for c in cases] == [
        "prefill 64", "decode b1 short", "decode b1 mixed", "decode b3 short", "decode b3 mixed",
    ]  # fmt: skip
    mixed = cases[-1]
    assert [len(p) for p in mixed.prompts] == [100, 32, 32]
    assert w.token_budget() == 100 + 2 * 32 + 1
    with pytest.raises(InvalidArgumentError, match="decode_tokens"):
        AttentionWorkload(decode_tokens=1)


def test_bench_guided_cli_on_tiny_checkpoint(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pdserve bench guided`` measures compiles, the batched mask and decode steps."""
    pytest.importorskip("xgrammar")
    out = tmp_path / "guided.json"
    argv = [
        "bench", "guided", "--model", str(tiny_llama_dir), "--batch", "3", "--steps", "2",
        "--rounds", "1", "--threads", "1", "--max-load", "1000", "--wait-s", "0",
        "--json", str(out),
    ]  # fmt: skip
    assert cli_main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["batch"] == 3 and doc["compile"]["first_guide_ms"] > 0
    for name in ("typical", "bounded"):
        assert doc["compile"][name]["cold_ms"] > doc["compile"][name]["cached_ms"]
        assert doc["mask"][name]["steps"] > 0 and doc["decode"][name]["step_ms"] > 0
        assert doc["sampler"][name]["step_ms"] > 0
    assert doc["decode"]["unguided"]["vs_unguided"] == 1.0
    assert "typical" in capsys.readouterr().out


class NoisyPeer(FakePeer):
    """A peer whose prefill's second sample is disturbed (3x), as by load elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.prefills = 0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        seconds = super().generate(prompts, max_tokens)
        if max_tokens == 1 and len(prompts[0]) == 10:
            self.prefills += 1
            if self.prefills == 3:  # the warm-up, then the second timed repeat
                return 3 * seconds
        return seconds


def test_a_case_whose_samples_spread_wide_is_repeated_up_to_the_cap() -> None:
    workload = Workload(prefill_lens=(10,), decode_batches=(1,), decode_prompt_len=5,
                        decode_tokens=9, repeats=3, warmup_tokens=4, max_spread=0.25)  # fmt: skip
    results = run_cases([NoisyPeer()], workload, vocab_size=100)["pdserve"]
    prefill = results["prefill_10"]
    assert len(prefill.seconds) == 6  # 3 rounds, then up to twice that: one sample stays 3x
    assert prefill.spread == pytest.approx(2.0)
    assert prefill.median_seconds == pytest.approx(0.51)  # the disturbed sample is outvoted
    assert len(results["decode_b1"].seconds) == 3  # steady: not repeated
    calm = run_cases([FakePeer()], workload, vocab_size=100)["pdserve"]
    assert len(calm["prefill_10"].seconds) == 3 and calm["prefill_10"].spread == 0.0
