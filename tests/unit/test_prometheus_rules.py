"""deploy/prometheus: the alert rules name only metrics the services export, promtool accepts
the rules and the compose scrape configuration, and ``promtool test rules`` (alerts_test.yml:
each alert fires on series shaped like ours, none on a healthy cluster) passes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from pdserve.kvstore.metrics import StoreCollector
from pdserve.kvstore.stats import StoreStats
from pdserve.telemetry.metrics import (
    GatewayMetrics,
    RouterMetrics,
    SchedulerMetrics,
    WorkerMetrics,
)

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_series() -> set[str]:
    """Every series name the services' metric helpers and the KV store collector expose."""
    store = StoreCollector()
    store.publish(StoreStats(0, 1, 0, 0, 0, 0, 0, 0))
    store_registry = CollectorRegistry()
    store_registry.register(store)
    registries = [
        RouterMetrics(process=False).registry,
        WorkerMetrics("decode", process=False).registry,
        SchedulerMetrics(process=False).registry,
        GatewayMetrics(process=False).registry,
        store_registry,
    ]
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        for suffix in _SUFFIXES[family.type]
    }


def rule_metric_names() -> set[str]:
    """The pdserve_* series the rules query (recording-rule names have colons)."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    exprs = [str(rule["expr"]) for group in groups for rule in group["rules"]]
    return {m for e in exprs for m in re.findall(r"\bpdserve_[a-z0-9_]+\b", e)}


def test_rules_name_only_exported_metrics() -> None:
    used = rule_metric_names()
    assert len(used) >= 10  # the parse found the rules' metrics
    assert used <= exported_series(), used - exported_series()


def test_every_alert_has_a_test_case() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {rule["alert"] for g in groups for rule in g["rules"] if "alert" in rule}
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
    firing = {
        case["alertname"]
        for test in tests
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert alerts == firing


@needs_promtool
def test_promtool_checks_rules_and_config(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    subprocess.run([PROMTOOL, "check", "rules", str(RULES)], check=True, timeout=60)
    # The compose configuration names the rules at their mount point; point it here.
    config = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(config.replace("/etc/pdserve/", f"{PROMETHEUS_DIR}/"))
    subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")], check=True, timeout=60
    )


@needs_promtool
def test_promtool_rule_tests_pass() -> None:
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(PROMETHEUS_DIR / "alerts_test.yml")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
