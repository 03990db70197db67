"""deploy/prometheus/alerts.yml in a real Prometheus scraping a running ``pdserve up``.

After real traffic (gRPC and HTTP), every rule evaluates without error, the SLO and hand-off
ratios hold values in [0, 1], every metric the rules query is stored (so the names are the
ones the services really export), and a worker target that does not answer raises
PdserveWorkerDown for that target alone.
"""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from pdserve.client import Client
from tests.integration.up_process import UpProcess, pdserve_up
from tests.unit.test_prometheus_rules import RULES, rule_metric_names

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus is not installed (Debian: apt-get install prometheus)",
    ),
]
# Disaggregated: the hand-off ratios need hand-offs, and the jobs are those of the compose file.
UP_ARGS = ("--port", "0", "--http-port", "0", "--mode", "disaggregated",
           "--worker-arg=--dtype=float32", "--worker-arg=--threads=1",
           "--worker-arg=--kv-blocks=256")  # fmt: skip
WAIT_S = 90.0
# A labelled counter has no series before its first increment; nothing fails Redis here.
ONLY_ON_ERRORS = {"pdserve_redis_errors_total"}


def wait_for(what: str, check: Callable[[], str | None], timeout_s: float = WAIT_S) -> None:
    """Poll until ``check`` returns None; it returns what it saw otherwise."""
    deadline = time.monotonic() + timeout_s
    seen = check()
    while seen is not None:
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last: {seen}"
        time.sleep(0.5)
        seen = check()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def up(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    with pdserve_up(tiny_llama_dir, UP_ARGS, tmp_path_factory.mktemp("up-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def dead_target() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def prometheus(
    up: UpProcess, dead_target: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Prometheus scraping every service ``pdserve up`` listed (jobs as in the compose
    configuration: pdserve-router, pdserve-decode, ...) plus one decode target that is down."""
    assert PROMETHEUS is not None
    jobs: dict[str, list[str]] = {}
    for name, url in up.metrics.items():
        target = url.removeprefix("http://").removesuffix("/metrics")
        jobs.setdefault(f"pdserve-{name.split('-')[0]}", []).append(target)
    jobs["pdserve-decode"].append(dead_target)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ],
    }
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:

        def ready() -> str | None:
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            try:
                return None if httpx.get(f"{url}/-/ready").status_code == 200 else "not ready"
            except httpx.TransportError as err:
                return str(err)

        wait_for("Prometheus to be ready", ready)

        def scraped() -> str | None:
            targets = api(url, "targets")["activeTargets"]
            live = [t for t in targets if not t["scrapeUrl"].startswith(f"http://{dead_target}/")]
            waiting = [t["scrapeUrl"] for t in live if t["health"] != "up"]
            return f"not scraped yet: {waiting}" if waiting or not live else None

        # Counters must be seen before the traffic moves them: rate() counts increases
        # between samples, and a series first scraped after the traffic never increases.
        wait_for("a first scrape of every service", scraped)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def api(url: str, path: str, **params: str) -> Any:
    reply = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=10)
    reply.raise_for_status()
    body = reply.json()
    assert body["status"] == "success", body
    return body["data"]


def send_traffic(up: UpProcess) -> None:
    """Streams (the router's TTFT and inter-token histograms see streamed tokens) and unary
    requests, over gRPC and HTTP."""
    with Client(up.router, timeout=60) as client:
        for i in range(3):
            assert list(client.stream(f"Request number {i}", max_tokens=8))
            client.generate(f"Unary number {i}", max_tokens=4)
    assert up.http_url is not None
    with openai.OpenAI(base_url=f"{up.http_url}/v1", api_key="unused") as oai:
        model = oai.models.list().data[0].id
        for _ in range(2):
            oai.completions.create(model=model, prompt="Over HTTP", max_tokens=4)
            assert list(oai.completions.create(model=model, prompt="Hi", max_tokens=4,
                                               stream=True))  # fmt: skip


def test_rules_evaluate_on_live_metrics(up: UpProcess, prometheus: str) -> None:
    send_traffic(up)
    wanted = rule_metric_names() - ONLY_ON_ERRORS

    def stored() -> str | None:
        names = set(api(prometheus, "label/__name__/values"))
        missing = wanted - names
        return f"not stored yet: {sorted(missing)}" if missing else None

    wait_for("every metric the rules use", stored)

    def both_sides() -> str | None:
        # One name has series on two targets (the prefill worker sends, the decode worker
        # receives): the name can be stored before the second side is scraped, and a side
        # first scraped after the second round would show rate() no increase.
        for side in ("send", "recv"):
            query = f'pdserve_kv_handoffs_total{{direction="{side}"}}'
            if not api(prometheus, "query", query=query)["result"]:
                return f"{query}: not scraped yet"
        return None

    wait_for("both sides of the hand-offs", both_sides)
    # Series born during the first round (hand-offs by transport, ...) start at their first
    # value; a second round gives rate() an increase to see.
    send_traffic(up)

    def ratios() -> str | None:
        for record in ("pdserve:ttft_over_slo:ratio_rate5m", "pdserve:itl_over_slo:ratio_rate5m",
                       "pdserve:kv_recompute:ratio_rate10m",
                       "pdserve:kv_handoff_fallback:ratio_rate10m"):  # fmt: skip
            result = api(prometheus, "query", query=record)["result"]
            if not result:
                return f"{record}: no value yet"
            value = float(result[0]["value"][1])
            if math.isnan(value):  # 0/0: no request in the window's rate yet
                return f"{record}: NaN"
            assert 0.0 <= value <= 1.0, (record, value)
        return None

    wait_for("the recorded SLO and hand-off ratios", ratios)
    roles = {
        r["metric"]["role"]
        for r in api(prometheus, "query", query="pdserve:queue_depth:avg")["result"]
    }
    assert roles == {"prefill", "decode"}

    def evaluated() -> str | None:
        rules = [r for g in api(prometheus, "rules")["groups"] for r in g["rules"]]
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not [b for b in bad if b[1]], bad  # an evaluation error is a broken rule
        return f"not evaluated yet: {bad}" if bad else None

    wait_for("every rule to evaluate", evaluated)


def test_a_silent_worker_raises_worker_down(prometheus: str, dead_target: str) -> None:
    def down_alert() -> str | None:
        alerts = api(prometheus, "alerts")["alerts"]
        down = [a for a in alerts if a["labels"]["alertname"] == "PdserveWorkerDown"]
        if not down:
            return f"alerts: {[a['labels']['alertname'] for a in alerts]}"
        assert [a["labels"]["instance"] for a in down] == [dead_target]
        assert down[0]["state"] in ("pending", "firing")
        return None

    wait_for("PdserveWorkerDown", down_alert)
    names = {a["labels"]["alertname"] for a in api(prometheus, "alerts")["alerts"]}
    assert "PdserveNoDecodeWorker" not in names  # the live decode worker is up
    assert "PdserveServiceDown" not in names
