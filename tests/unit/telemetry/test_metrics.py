"""Service metrics, scraped over a real socket and parsed as Prometheus text."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.metrics import (
    GatewayMetrics,
    RouterMetrics,
    SchedulerMetrics,
    WorkerMetrics,
)
from pdserve.telemetry.metrics_http import start_metrics_server


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: list[Sample] = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}


def test_router_metrics_over_http() -> None:
    m = RouterMetrics()
    ttft = [0.004, 0.02, 0.02, 0.9]
    for v in ttft:
        m.observe_ttft(v)
    for v in (0.003, 0.012):
        m.observe_itl(v)
    m.observe_finished(1.5, prompt_tokens=7, generated=5, reason="length")
    m.observe_finished(0.25, prompt_tokens=3, generated=1, reason="stop")
    m.count_request("ok")
    m.count_request("ok")
    m.count_request("error")
    with start_metrics_server(m.registry, 0) as server:
        assert server.port > 0
        got = _scrape(server.url)
    assert got[("pdserve_ttft_seconds_count", ())] == len(ttft)
    assert got[("pdserve_ttft_seconds_sum", ())] == pytest.approx(sum(ttft))
    # Cumulative buckets: count of observations <= le.
    for le in ("0.005", "0.025", "1.0", "+Inf"):
        expected = sum(v <= float(le) for v in ttft)
        assert got[("pdserve_ttft_seconds_bucket", (("le", le),))] == expected
    assert got[("pdserve_inter_token_latency_seconds_count", ())] == 2
    assert got[("pdserve_inter_token_latency_seconds_sum", ())] == pytest.approx(0.015)
    assert got[("pdserve_e2e_latency_seconds_count", ())] == 2
    # The same under vLLM's names, labelled with the model.
    model = (("model_name", "pdserve"),)
    assert got[("vllm:time_to_first_token_seconds_count", model)] == len(ttft)
    assert got[("vllm:time_to_first_token_seconds_sum", model)] == pytest.approx(sum(ttft))
    assert got[("vllm:inter_token_latency_seconds_count", model)] == 2
    assert got[("vllm:e2e_request_latency_seconds_sum", model)] == pytest.approx(1.75)
    assert got[("vllm:prompt_tokens_total", model)] == 10
    assert got[("vllm:generation_tokens_total", model)] == 6
    for reason in ("length", "stop"):
        assert got[("vllm:request_success_total", (("finished_reason", reason), *model))] == 1
    assert got[("pdserve_requests_total", (("outcome", "ok"),))] == 2
    assert got[("pdserve_requests_total", (("outcome", "error"),))] == 1
    assert ("process_cpu_seconds_total", ()) in got  # the per-service process collector


def test_worker_and_scheduler_metrics_over_http() -> None:
    w = WorkerMetrics("decode", model_name="demo")
    w.set_engine_load(running=5, waiting=3, free=40, total=128)
    w.set_queue_depth(1, role="prefill")
    w.observe_transfer("grpc", "recv", 1_000_000, 0.01)
    w.observe_transfer("grpc", "recv", 3_000_000, 0.03)
    w.observe_transfer("shm", "send", 500, 0.0001)
    w.count_redis_error("heartbeat")
    s = SchedulerMetrics(process=False)
    s.count_decision("least_loaded", "assigned")
    s.count_decision("least_loaded", "no_capacity")
    s.count_conflict()
    s.count_conflict(2)
    s.count_redis_error("claim")
    with start_metrics_server(w.registry, 0) as ws, start_metrics_server(s.registry, 0) as ss:
        assert ws.port != ss.port
        worker, scheduler = _scrape(ws.url), _scrape(ss.url)
    assert worker[("pdserve_queue_depth", (("role", "decode"),))] == 3
    assert worker[("pdserve_queue_depth", (("role", "prefill"),))] == 1
    assert worker[("pdserve_kv_blocks_free", (("role", "decode"),))] == 40
    assert worker[("pdserve_kv_blocks_total", (("role", "decode"),))] == 128
    model = (("model_name", "demo"),)
    assert worker[("vllm:num_requests_running", model)] == 5
    assert worker[("vllm:num_requests_waiting", model)] == 3
    assert worker[("vllm:kv_cache_usage_perc", model)] == pytest.approx(88 / 128)
    grpc_recv = (("direction", "recv"), ("transport", "grpc"))
    assert worker[("pdserve_kv_transfer_bytes_total", grpc_recv)] == 4_000_000
    assert worker[("pdserve_kv_transfer_seconds_count", grpc_recv)] == 2
    assert worker[("pdserve_kv_transfer_seconds_sum", grpc_recv)] == pytest.approx(0.04)
    assert (
        worker[("pdserve_kv_transfer_bytes_total", (("direction", "send"), ("transport", "shm")))]
        == 500
    )
    assert worker[("pdserve_redis_errors_total", (("operation", "heartbeat"),))] == 1
    assert (
        scheduler[
            (
                "pdserve_scheduler_decisions_total",
                (("outcome", "assigned"), ("policy", "least_loaded")),
            )
        ]
        == 1
    )
    assert scheduler[("pdserve_scheduler_conflicts_total", ())] == 3
    assert scheduler[("pdserve_redis_errors_total", (("operation", "claim"),))] == 1
    assert ("process_cpu_seconds_total", ()) not in scheduler
    # Separate registries: nothing of one service leaks into another's scrape.
    assert not any(name.startswith("pdserve_scheduler") for name, _ in worker)
    assert not any(name.startswith("pdserve_queue") for name, _ in scheduler)


def test_two_instances_in_one_process_do_not_collide() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.observe_ttft(0.1)
    assert b.registry.get_sample_value("pdserve_ttft_seconds_count") == 0
    assert a.registry.get_sample_value("pdserve_ttft_seconds_count") == 1


def test_invalid_observations_are_rejected() -> None:
    r, w = RouterMetrics(process=False), WorkerMetrics("prefill", process=False)
    with pytest.raises(InvalidArgumentError):
        r.observe_ttft(-0.1)
    with pytest.raises(InvalidArgumentError):
        r.observe_itl(float("nan"))
    with pytest.raises(InvalidArgumentError):
        w.observe_transfer("grpc", "sideways", 1, 0.1)
    with pytest.raises(InvalidArgumentError):
        w.observe_transfer("", "send", 1, 0.1)
    with pytest.raises(InvalidArgumentError):
        w.set_kv_blocks(free=10, total=5)
    with pytest.raises(InvalidArgumentError):
        WorkerMetrics("")
    with pytest.raises(InvalidArgumentError):
        start_metrics_server(r.registry, 70000)


def test_handoffs_and_gateway_metrics() -> None:
    w = WorkerMetrics("decode", process=False)
    w.count_handoff("shm", "recv", fallback=False)
    w.count_handoff("recompute", "recv", fallback=True)
    w.count_handoff("recompute", "recv", fallback=True)
    g = GatewayMetrics(process=False)
    g.observe_request("/v1/completions", 200, 0.2)
    g.observe_request("/v1/completions", 429, 0.01)
    g.observe_request("/v1/completions", 200, 3.0)
    with start_metrics_server(w.registry, 0) as ws, start_metrics_server(g.registry, 0) as gs:
        worker, gateway = _scrape(ws.url), _scrape(gs.url)
    ok = (("direction", "recv"), ("outcome", "ok"), ("transport", "shm"))
    fell_back = (("direction", "recv"), ("outcome", "fallback"), ("transport", "recompute"))
    assert worker[("pdserve_kv_handoffs_total", ok)] == 1
    assert worker[("pdserve_kv_handoffs_total", fell_back)] == 2
    route = ("route", "/v1/completions")
    assert gateway[("pdserve_http_requests_total", (route, ("status", "200")))] == 2
    assert gateway[("pdserve_http_requests_total", (route, ("status", "429")))] == 1
    assert gateway[("pdserve_http_request_seconds_count", (route,))] == 3
    assert gateway[("pdserve_http_request_seconds_bucket", (("le", "0.25"), route))] == 2
    with pytest.raises(InvalidArgumentError):
        w.count_handoff("shm", "sideways", fallback=False)
    with pytest.raises(InvalidArgumentError):
        g.observe_request("", 200, 0.1)
