"""vLLM's metric names on a running cluster: what a dashboard or autoscaler built for vLLM
reads, scraped from the router's and the workers' ``/metrics`` after real requests."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.client import Client
from pdserve.launcher import Cluster
from tests.integration.metrics_probe import metric

pytestmark = pytest.mark.integration

WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256")


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Cluster]:
    with Cluster(tiny_llama_dir, mode="conditional", worker_args=WORKER_ARGS) as c:
        yield c


def test_request_families_count_what_was_served(cluster: Cluster) -> None:
    model = cluster.model_dir.name
    router = cluster.metrics_urls()["router"]
    prompts = [list(range(10, 10 + n)) for n in (12, 30, 7)]
    with Client(cluster.router_address, timeout=60) as client:
        done = [client.generate(p, max_tokens=6, temperature=0, ignore_eos=True) for p in prompts]
        stopped = client.generate(prompts[0], max_tokens=6, temperature=0,
                                  stop_token_ids=[done[0].token_ids[1]])  # fmt: skip
    served = [*done, stopped]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 2

    def got(name: str, **labels: str) -> float:
        return metric(router, name, model_name=model, **labels)

    assert got("vllm:prompt_tokens_total") == sum(len(p) for p in prompts) + len(prompts[0])
    assert got("vllm:generation_tokens_total") == sum(len(r.token_ids) for r in served)
    assert got("vllm:request_success_total", finished_reason="length") == len(done)
    assert got("vllm:request_success_total", finished_reason="stop") == 1
    assert got("vllm:time_to_first_token_seconds_count") == len(served)
    assert got("vllm:e2e_request_latency_seconds_count") == len(served)
    gaps = sum(len(r.token_ids) - 1 for r in served)
    assert got("vllm:inter_token_latency_seconds_count") == gaps


def test_engine_families_follow_the_workers_load(cluster: Cluster) -> None:
    model = cluster.model_dir.name
    workers = {s.name: cluster.metrics_urls()[s.name] for s in cluster.workers()}
    with Client(cluster.router_address, timeout=120) as client:
        stream = client.stream(list(range(40, 60)), max_tokens=2000, temperature=0,
                               ignore_eos=True)  # fmt: skip
        with stream:
            tokens = iter(stream)
            next(tokens)  # under way: some worker decodes it
            deadline = time.monotonic() + 60
            while True:  # the gauges refresh at scrape time; poll until the stream shows
                running = {n: metric(u, "vllm:num_requests_running", model_name=model)
                           for n, u in workers.items()}  # fmt: skip
                if sum(running.values()) >= 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # polling another process's gauges: nothing to wait on
            assert sum(running.values()) >= 1, running
            busy = max(running, key=lambda n: running[n])
            usage = metric(workers[busy], "vllm:kv_cache_usage_perc", model_name=model)
            assert 0 < usage <= 1
    for url in workers.values():  # every engine worker exports the whole set
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for family in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f'vllm:{family}{{model_name="{model}"}}' in text, family
