"""`pdserve bench serve` from the command line: options, and a whole run against a local
OpenAI-style server with every output written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main as cli_main
from pdserve.errors import InvalidArgumentError
from pdserve_bench.serve.cli import main, parser
from pdserve_bench.serve.settings import DEFAULT_RATE, DEFAULT_REQUESTS, settings

from .fakes import FakeOpenAI, url_of


def test_targets_keep_command_line_order_and_their_labels() -> None:
    args = parser().parse_args(
        ["--openai-url", "http://h:1", "--label", "vllm", "--router", "r:2",
         "--config", "colocated", "--label", "col"]
    )  # fmt: skip
    assert [(t.kind, t.value, t.label) for t in args.targets] == [
        ("openai_url", "http://h:1", "vllm"),
        ("router", "r:2", None),
        ("config", "colocated", "col"),
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--label", "x", "--router", "r:1"],  # a label before any target
        ["--router", "r:1", "--label", "a", "--label", "b"],
        ["--router", "r:1", "--rates", "2,-1"],
        ["--router", "r:1", "--burst", "0"],
        ["--router", "r:1", "--itl-slo", "fast"],
    ],
)
def test_bad_command_lines_exit_with_a_message(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rates", "2"], "give a target"),
        (["--router", "r:1", "--router", "r:1"], "different labels"),
        (["--router", "r:1", "--json", "/nonexistent-dir/x.json"], "folder does not exist"),
    ],
)
def test_refused_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_settings_defaults_and_units() -> None:
    s = settings(
        parser().parse_args(["--router", "r:1", "--itl-slo", "0.2s", "--ttft-slo", "500ms"])
    )
    assert s.rates == [DEFAULT_RATE] and s.load.num_requests == DEFAULT_REQUESTS
    assert s.load.vocab_size == 32000  # the small demo preset's vocabulary
    assert (s.slo.ttft_s, s.slo.itl_s) == (0.5, 0.2)
    assert s.search is None
    s = settings(parser().parse_args(["--router", "r:1", "--rates", "2,4,8", "--search"]))
    assert s.search is not None and (s.search.low, s.search.high) == (2.0, 8.0)
    s = settings(parser().parse_args(["--router", "r:1", "--burst", "all"]))
    assert s.rates == [None] and s.load.burst == 0
    with pytest.raises(InvalidArgumentError, match="--rates"):
        settings(parser().parse_args(["--router", "r:1", "--burst", "all", "--rates", "3"]))


def test_a_bad_trace_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_tokens": 5}\n')
    with pytest.raises(SystemExit):
        main(["--router", "r:1", "--trace", str(trace)])
    assert "t.jsonl:1" in capsys.readouterr().err


def test_whole_run_writes_table_json_png_and_html(
    openai_server: FakeOpenAI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = {k: tmp_path / f"run.{k}" for k in ("json", "png", "html")}
    code = cli_main(
        ["bench", "serve", "--openai-url", url_of(openai_server), "--label", "peer",
         "--openai-url", url_of(openai_server) + "/v1", "--label", "again",
         "--vocab-size", "1000", "--mix", "short-only", "--num-requests", "5", "--warmup", "1",
         "--rates", "300,600", "--json", str(out["json"]), "--plot", str(out["png"]),
         "--html", str(out["html"]), "--quiet"]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "peer: OpenAI-compatible" in printed and "side by side:" in printed
    doc = json.loads(out["json"].read_text())
    assert [t["label"] for t in doc["targets"]] == ["peer", "again"]
    assert [(p["target"], p["rate"]) for p in doc["points"]] == [
        ("peer", 300.0), ("again", 300.0), ("peer", 600.0), ("again", 600.0),
    ]  # fmt: skip
    for p in doc["points"]:
        assert len(p["records"]) == 6 and p["summary"]["sent"] == 5
        assert p["summary"]["goodput"] == 1.0
    assert doc["config"]["slo"] == {"ttft_s": 3.0, "itl_s": 0.15}
    assert doc["config"]["argv"][:4] == ["bench", "serve", "--openai-url", url_of(openai_server)]
    assert doc["machine"]["logical_cpus"] and "load_1min_end" in doc["machine"]
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = out["html"].read_text()
    assert "data:image/png;base64," in html and "<h2>peer</h2>" in html
    assert len(openai_server.bodies) == 2 * 2 * 6


def test_cluster_options_apply_to_the_config_before_them(tmp_path: Path) -> None:
    from pdserve_bench.serve.cli_targets import cluster_spec, labels

    model = tmp_path / "m"
    args = parser().parse_args(
        ["--model", str(model), "--worker-arg=--threads=2",
         "--config", "conditional", "--workers", "1:2", "--scheduler-arg=--policy=least_loaded",
         "--router-arg=--mode=colocated", "--target-worker-arg=--lane=long", "--label", "a",
         "--config", "disaggregated"]
    )  # fmt: skip
    first, second = args.targets
    spec = cluster_spec(args, first.value, first)
    assert (spec.prefill, spec.decode) == (1, 2)
    assert spec.scheduler_args == ("--policy=least_loaded",)
    assert spec.router_args == ("--mode=colocated",)
    assert spec.worker_args[-2:] == ("--threads=2", "--lane=long")
    plain = cluster_spec(args, second.value, second)
    assert (plain.prefill, plain.decode, plain.scheduler_args) == (1, 1, ())
    assert labels(args) == ["a", "pdserve-disaggregated-1p1d"]
    planned = parser().parse_args(
        ["--config", "conditional", "--workers", "2:3", "--duties", "prefill,any,decode",
         "--lanes", "long,any", "--planner", "--planner=--cooldown-s=5"]
    )  # fmt: skip
    spec = cluster_spec(planned, "conditional", planned.targets[0])
    assert spec.duties == ("prefill", "", "decode") and spec.lanes == ("long", "")
    assert spec.planner_args == ("--cooldown-s=5",)
    assert cluster_spec(args, second.value, second).planner_args is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--scheduler-arg=--policy=x", "--config", "conditional"],  # before any cluster
        ["--router", "r:1", "--workers", "1:1"],  # after a router, not a cluster
        ["--config", "conditional", "--workers", "1:0"],
        ["--config", "conditional", "--workers", "two"],
        ["--config", "conditional", "--duties", "prefill,cook"],
    ],
)
def test_misplaced_cluster_options_are_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err
