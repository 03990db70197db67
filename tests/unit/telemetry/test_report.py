"""``pdserve trace report`` end to end: span file and Jaeger in, table, PNG and HTML out."""

from __future__ import annotations

import json
import re
import struct
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from pdserve.cli import main
from pdserve.telemetry import report
from pdserve.telemetry.breakdown import compute_breakdown
from pdserve.telemetry.jaeger import parse_jaeger_traces
from pdserve.telemetry.record import SpanRecord
from pdserve.telemetry.span_file import read_span_file

from .synthetic import ROOT, STAGE_NAMES, SyntheticTraces, make_traces, to_jaeger

N_REQUESTS = 24


@pytest.fixture(scope="module")
def synth() -> SyntheticTraces:
    return make_traces(N_REQUESTS, seed=11)


@pytest.fixture
def span_file(tmp_path: Path, synth: SyntheticTraces) -> Path:
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in synth.lines))
    return path


def _table(stdout: str) -> dict[str, list[float]]:
    """The printed rows: stage -> [n, p50, p90, p99, mean, share%]."""
    names = {ROOT, *STAGE_NAMES}
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in names:
            rows[parts[0]] = [float(p.rstrip("%")) for p in parts[1:]]
    return rows


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The report over ``argv``; a finished file needs no wait for late spans (the synthetic
    traces include one without its router.request, which a wait would wait out)."""
    if "--wait-s" not in argv:
        argv = [*argv, "--wait-s", "0"]
    rc = main(["trace", "report", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_report_from_a_span_file(
    span_file: Path, tmp_path: Path, synth: SyntheticTraces, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "out"
    rc, stdout, _ = _run(["--span-file", str(span_file), "--out", str(out_dir)], capsys)
    assert rc == 0
    table = _table(stdout)
    assert list(table) == [ROOT, *STAGE_NAMES]
    total_e2e_ms = sum(synth.e2e_ns) / 1e6
    for stage, durations in [(ROOT, synth.e2e_ns), *synth.stage_ns.items()]:
        ms = np.array(durations) / 1e6
        n, p50, p90, p99, mean, share = table[stage]
        assert n == len(durations)
        # Printed with 3 decimals (ms) and 1 decimal (%).
        assert p50 == pytest.approx(np.percentile(ms, 50), abs=5e-4 + 1e-9)
        assert p90 == pytest.approx(np.percentile(ms, 90), abs=5e-4 + 1e-9)
        assert p99 == pytest.approx(np.percentile(ms, 99), abs=5e-4 + 1e-9)
        assert mean == pytest.approx(ms.mean(), abs=5e-4 + 1e-9)
        assert share == pytest.approx(100 * ms.sum() / total_e2e_ms, abs=0.05 + 1e-9)
    assert "1 trace(s) without router.request skipped" in stdout

    png = (out_dir / "breakdown.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 400 and height >= 300
    with Image.open(out_dir / "breakdown.png") as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None
    # Not a blank canvas: a background plus at least one distinct colour per stage.
    assert len([c for c in colours if c[0] > 50]) > len(STAGE_NAMES)

    html = (out_dir / "breakdown.html").read_text()
    for stage in (ROOT, *STAGE_NAMES):
        assert stage in html
    assert len(re.findall(r"<tr class=\"req\">", html)) == N_REQUESTS
    for request_id in synth.request_ids:
        assert f"<td>{request_id}</td>" in html
    # Self-contained: no scripts, no external resources.
    assert "<script" not in html.lower()
    assert not re.search(r"(src|href)\s*=", html, re.IGNORECASE)
    assert "http://" not in html and "https://" not in html


def test_jaeger_json_gives_the_same_breakdown(span_file: Path, synth: SyntheticTraces) -> None:
    from_file = compute_breakdown(read_span_file(span_file))
    payload = json.loads(json.dumps(to_jaeger(synth.lines)))
    from_jaeger = compute_breakdown(parse_jaeger_traces(payload))
    assert from_jaeger == from_file
    assert len(from_jaeger.requests) == N_REQUESTS


class _FakeJaeger(BaseHTTPRequestHandler):
    payload: dict[str, Any] = {}
    queries: list[dict[str, list[str]]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/api/traces":
            self.send_error(404)
            return
        self.queries.append(urllib.parse.parse_qs(url.query))
        body = json.dumps(self.payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep the test output clean


@pytest.fixture
def jaeger_url(synth: SyntheticTraces) -> Iterator[tuple[str, list[dict[str, list[str]]]]]:
    queries: list[dict[str, list[str]]] = []

    class Handler(_FakeJaeger):
        pass

    Handler.payload, Handler.queries = to_jaeger(synth.lines), queries
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", queries
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_report_from_a_jaeger_query_service(
    jaeger_url: tuple[str, list[dict[str, list[str]]]],
    span_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, queries = jaeger_url
    argv = ["--jaeger", url, "--service", "pdserve-router", "--limit", "50"]
    rc, from_jaeger, _ = _run([*argv, "--out", str(tmp_path / "j")], capsys)
    assert rc == 0
    (query,) = queries
    assert query["service"] == ["pdserve-router"] and query["limit"] == ["50"]
    assert int(query["start"][0]) < int(query["end"][0])
    rc, from_file, _ = _run(["--span-file", str(span_file), "--out", str(tmp_path / "f")], capsys)
    assert rc == 0
    assert _table(from_jaeger) == _table(from_file)
    assert (tmp_path / "j" / "breakdown.png").is_file()


def test_failures_are_reported_as_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_requests = tmp_path / "spans.jsonl"
    line = {"trace_id": "a" * 32, "span_id": "b" * 16, "name": "x", "start_ns": 1, "end_ns": 2}
    no_requests.write_text(json.dumps(line) + "\n")
    rc, _, err = _run(["--span-file", str(no_requests), "--out", str(tmp_path)], capsys)
    assert rc == 2 and "no router.request span among 1 spans" in err
    rc, _, err = _run(["--span-file", str(tmp_path / "missing.jsonl")], capsys)
    assert rc == 2 and "--span-file" in err
    # A port nothing listens on: bind one, close it, and use it.
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()
    rc, _, err = _run(["--jaeger", f"http://127.0.0.1:{port}"], capsys)
    assert rc == 2 and "cannot reach Jaeger" in err


def _without_decode_generate(synth: SyntheticTraces) -> tuple[list[dict[str, Any]], str]:
    """The synthetic lines minus one request's ``decode.generate``, and that trace's id."""
    line = next(ln for ln in synth.lines if ln["name"] == "decode.generate")
    return [ln for ln in synth.lines if ln is not line], str(line["trace_id"])


def test_a_request_still_arriving_is_waited_for(
    tmp_path: Path, synth: SyntheticTraces, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Without the synthetic trace that has no router.request: it would be waited out too.
    rooted = {ln["trace_id"] for ln in synth.lines if ln["name"] == ROOT}
    whole = [ln for ln in synth.lines if ln["trace_id"] in rooted]
    partial, _ = _without_decode_generate(synth)
    reads = [[ln for ln in partial if ln["trace_id"] in rooted], whole]  # the second is whole

    def load(ns: object) -> tuple[list[SpanRecord], str]:
        lines = reads.pop(0) if len(reads) > 1 else reads[0]
        path = tmp_path / "now.jsonl"
        path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
        return read_span_file(path), "test"

    monkeypatch.setattr(report, "load_spans", load)
    monkeypatch.setattr(report, "_POLL_S", 0.0)
    rc, stdout, _ = _run(["--span-file", "unused", "--out", str(tmp_path / "o"), "--wait-s", "60"],
                         capsys)  # fmt: skip
    assert rc == 0 and not reads[1:]  # read twice: once partial, once whole
    assert "incomplete" not in stdout
    assert _table(stdout)[ROOT][0] == N_REQUESTS


def test_a_request_incomplete_after_the_wait_is_named_and_left_out(
    tmp_path: Path, synth: SyntheticTraces, capsys: pytest.CaptureFixture[str]
) -> None:
    partial, trace_id = _without_decode_generate(synth)
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(ln) + "\n" for ln in partial))
    rc, stdout, _ = _run(["--span-file", str(path), "--out", str(tmp_path / "o")], capsys)
    assert rc == 0
    assert (
        f"1 trace(s) still incomplete after waiting 0 s, left out of the breakdown: "
        f"{trace_id} lacks decode.generate" in stdout
    )
    assert _table(stdout)[ROOT][0] == N_REQUESTS - 1
