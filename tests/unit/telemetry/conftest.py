"""Fixtures: an SDK tracer provider recording into memory, never installed process-wide."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@pytest.fixture
def memory_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(memory_exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """A provider whose finished spans land in ``memory_exporter`` synchronously."""
    p = TracerProvider(resource=Resource.create({"service.name": "unit-test"}))
    p.add_span_processor(SimpleSpanProcessor(memory_exporter))
    yield p
    p.shutdown()
