"""Reading a service's Prometheus ``/metrics`` from a test."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of samples ``name`` whose labels include ``labels``."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
