"""``pdserve trace report`` on the span file a real cluster wrote.

A disaggregated cluster started with a trace file (``Cluster(trace_file=...)``, which is how
``pdserve up --trace-file`` runs; from ``cluster_driver.py``, in a process of its own) serves a
few concurrent requests and is stopped, flushing every service's spans into the one shared
file. ``pdserve trace report --span-file`` must then
find every request with every stage, print the per-stage table, and write the PNG and the
HTML page.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_driver import run_driver  # tests/integration is on sys.path

from pdserve.cli import main
from pdserve.models.demo import init_checkpoint

pytestmark = pytest.mark.integration

# As docs/observability.md names them.
STAGES = (
    "router.mode_decision",
    "scheduler.assign",
    "prefill.queue",
    "prefill.compute",
    "kv.transfer.send",
    "kv.transfer.recv",
    "decode.queue",
    "decode.first_token",
    "decode.generate",
)
SERVICES = {"router", "scheduler", "prefill", "decode", "kvstore"}
WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
               "--heartbeat-interval-s", "0.2", "--transport", "store")  # fmt: skip
REQUESTS = {"report-0": ("once upon a time", 4), "report-1": ("in a land far away", 7),
            "report-2": ("there lived a", 5)}  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def span_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("report")
    model = init_checkpoint(work / "model", "tiny", dtype="float32", max_position_embeddings=256)
    path = work / "spans.jsonl"
    config = {
        "model": str(model),
        "worker_args": list(WORKER_ARGS),
        "trace_file": str(path),
        # The span file alone: no OTLP, whatever the environment says.
        "env": {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "none"},
        "requests": [
            {"request_id": rid, "prompt": prompt, "max_tokens": n}
            for rid, (prompt, n) in REQUESTS.items()
        ],
        "out": str(work / "out.json"),
    }
    seen = run_driver(config, work / "config.json")
    assert {rid: len(t) for rid, t in seen["tokens"].items()} == {
        rid: n for rid, (_, n) in REQUESTS.items()
    }
    return path  # the driver stopped the cluster: every service flushed its spans


def test_every_service_wrote_to_the_shared_file(span_file: Path) -> None:
    lines = [json.loads(line) for line in span_file.read_text().splitlines()]
    assert {rec["service"].removeprefix("pdserve-") for rec in lines} == SERVICES
    request_ids = {
        rec["attributes"].get("pdserve.request_id")
        for rec in lines
        if rec["name"] == "router.request"
    }
    assert request_ids == set(REQUESTS)


def test_report_breaks_every_request_into_every_stage(
    span_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert main(["trace", "report", "--span-file", str(span_file), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()
        for line in printed.splitlines()
        if line.split() and line.split()[0] in {"router.request", *STAGES}
    }
    assert set(rows) == {"router.request", *STAGES}, printed
    for name, row in rows.items():
        assert int(row[1]) == len(REQUESTS), row  # every request went through every stage
        p50, p90, p99, mean = (float(v) for v in row[2:6])
        assert 0 <= p50 <= p90 <= p99, row
        assert mean >= 0, name
    assert f"{len(REQUESTS)} requests" in printed

    png = (out / "breakdown.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    html = (out / "breakdown.html").read_text()
    for name in STAGES:
        assert name in html, name
    for rid in REQUESTS:
        assert rid in html, rid
