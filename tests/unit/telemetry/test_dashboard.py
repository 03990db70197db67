"""The Grafana dashboard queries only metrics that the metrics module defines."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.telemetry.metrics import RouterMetrics, SchedulerMetrics, WorkerMetrics

DASHBOARD = Path(__file__).parents[3] / "deploy" / "grafana" / "pdserve-dashboard.json"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "bool", "offset"}  # fmt: skip

# Sample names a family of each type exposes, from its family name.
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def _defined_series() -> dict[str, str]:
    """Every series name the three helpers expose -> its family name."""
    registries: list[CollectorRegistry] = [
        RouterMetrics(process=False).registry,
        WorkerMetrics("decode", process=False).registry,
        SchedulerMetrics(process=False).registry,
    ]
    series = {}
    for registry in registries:
        for family in registry.collect():
            for suffix in _SUFFIXES[family.type]:
                series[family.name + suffix] = family.name
    return series


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (not functions, labels, keywords or numbers)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors, $__rate_interval
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", expr):
        if m.group(1) not in _KEYWORDS:
            names.add(m.group(1))
    return names


def _targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def test_the_expression_parser_finds_metric_names() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, x) (rate(a_b_bucket{role="decode"}[5m]))) / c'
    assert _metric_names(expr) == {"a_b_bucket", "c"}


def test_every_query_names_only_defined_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    defined = _defined_series()
    targets = _targets(dashboard)
    assert len(targets) >= 10
    used_families = set()
    for title, expr in targets:
        names = _metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        unknown = names - defined.keys()
        assert not unknown, f"{title}: {sorted(unknown)} not defined in pdserve.telemetry.metrics"
        used_families |= {defined[n] for n in names}
    # The panels the dashboard is for: latency, queues, KV, transfers, scheduler, Redis.
    assert used_families >= {
        "pdserve_ttft_seconds",
        "pdserve_inter_token_latency_seconds",
        "pdserve_e2e_latency_seconds",
        "pdserve_queue_depth",
        "pdserve_kv_blocks_free",
        "pdserve_kv_transfer_bytes",
        "pdserve_kv_transfer_seconds",
        "pdserve_scheduler_conflicts",
        "pdserve_redis_errors",
        "pdserve_kv_transfer_bytes_per_second",
        "pdserve_kv_transfer_peak_bytes_per_second",
        "pdserve_kv_link_capacity_bytes_per_second",
    }


def test_panels_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
