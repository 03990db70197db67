"""docs/observability.md names every span, attribute key and metric the library defines."""

from __future__ import annotations

from pathlib import Path

from pdserve.telemetry import spans
from pdserve.telemetry.metrics import (
    PlannerMetrics,
    RouterMetrics,
    SchedulerMetrics,
    WorkerMetrics,
)

DOC = Path(__file__).parents[3] / "docs" / "observability.md"


def test_every_span_and_attribute_is_documented() -> None:
    text = DOC.read_text()
    for spec in spans.SPANS:
        assert f"| `{spec.name}` | {spec.service.removeprefix('pdserve-')} |" in text, spec.name
        for key in spec.attributes:
            assert f"`{key}`" in text, key


def test_every_metric_is_documented_with_its_type() -> None:
    text = DOC.read_text()
    helpers = (
        RouterMetrics,
        SchedulerMetrics,
        PlannerMetrics,
        lambda process: WorkerMetrics("decode", process=process, model_name="m"),
    )
    for make in helpers:
        for family in make(process=False).registry.collect():
            exposed = family.name + ("_total" if family.type == "counter" else "")
            assert f"| `{exposed}` | {family.type} |" in text, exposed
