"""What the router measures of each request: the ``router.request`` span and client latencies.

``RouterTelemetry.request(tenant)`` wraps one request's handling in the router::

    with telemetry.request(tenant) as observed:        # router.request starts
        route = prepare(...)
        observed.prepared(route)                       # request id, prompt tokens
        async for chunk in flow.generate(route, observed=observed):
            observed.chunk(chunk)                      # TTFT, inter-token gaps
            ...send it...
            if chunk.finished:
                observed.finish()                      # the last chunk is out: span ends
                break
    # the flow's clean-up (reservation release, ...) runs after this, outside the span

``router.request`` is the request's root stage and its duration the end-to-end latency. It is
deliberately *not* made the current span: the downstream calls (CLIENT spans) hang off the
Router call's SERVER span, which lasts until the clean-up is done (but for the release of a
finished request's reservation, which outlives the call: it is the root of a trace of its own,
``router.release``, linked to ``router.request``; see ``detached``), while every stage, in every
service, is a child of ``router.request`` (the flow hands its context over with each call, see
``pdserve.telemetry.handover``). So each span lies inside its parent, and the stages, which
follow each other without gaps, add up to the end-to-end time.

The metrics are those of ``RouterMetrics``: the time to the first token and between tokens
*as the router receives them*, end to end (successful requests only: failures would drag the
latency histograms towards their failure time) and one count per finished request by outcome
(``ok``, ``error``, ``cancelled``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from pdserve.convert import MODE_NAMES
from pdserve.engine.outputs import FinishReason
from pdserve.request_key import RequestKey
from pdserve.router.output import RouteChunk
from pdserve.router.request import RouteRequest
from pdserve.telemetry import tracing
from pdserve.telemetry.metrics import RouterMetrics
from pdserve.telemetry.spans import (
    ATTR_ARM,
    ATTR_LONG_PROMPT,
    ATTR_MODE,
    ATTR_MODE_REASON,
    ATTR_PREFIX_HIT_TOKENS,
    ATTR_PROMPT_TOKENS,
    ATTR_REQUEST_ID,
    ATTR_STALL_MS,
    ATTR_TENANT,
    ATTR_TTFT_COLOCATED,
    ATTR_TTFT_DISAGGREGATED,
    ROUTER_MODE_DECISION,
    ROUTER_REQUEST,
)
from pdserve.v1 import common_pb2, scheduler_pb2

OUTCOME_OK = "ok"
OUTCOME_ERROR = "error"
OUTCOME_CANCELLED = "cancelled"

_INSTRUMENTATION_NAME = "pdserve"

MODE_REASON_CONFIGURED = "configured"
"""``pdserve.mode_reason`` when the mode asked for decided (an older scheduler says no more)."""
MODE_REASON_NOT_PLACED = "not_placed"
"""``pdserve.mode_reason`` of a request the scheduler did not place (refused, failed)."""


def record_mode_decision(
    root: trace.Span | None,
    start_ns: int,
    end_ns: int,
    asked: common_pb2.Mode,
    request: RouteRequest,
    arm: str,
    assignment: scheduler_pb2.Assignment | None,
) -> None:
    """``router.mode_decision`` under ``root``, from ``start_ns`` to ``end_ns``: the router's
    part before asking for placement (validation, tokenization, the arm), with the mode the
    request got (``asked`` when it was not placed) and the scheduler's reasons."""
    attributes: dict[str, str | int | float | bool] = {
        ATTR_MODE: MODE_NAMES.get(assignment.mode if assignment else asked, "unspecified"),
        ATTR_MODE_REASON: MODE_REASON_NOT_PLACED if assignment is None else MODE_REASON_CONFIGURED,
        ATTR_PROMPT_TOKENS: len(request.prompt_token_ids),
        ATTR_ARM: arm,
    }
    if assignment is not None and assignment.HasField("decision"):
        d = assignment.decision
        attributes.update(
            {
                ATTR_MODE_REASON: d.reason or MODE_REASON_CONFIGURED,
                ATTR_LONG_PROMPT: d.long_prompt,
                ATTR_PREFIX_HIT_TOKENS: d.cached_tokens,
                ATTR_STALL_MS: d.stall_s * 1000.0,
            }
        )
        if d.HasField("colocated_ttft_s"):
            attributes[ATTR_TTFT_COLOCATED] = d.colocated_ttft_s
        if d.HasField("disaggregated_ttft_s"):
            attributes[ATTR_TTFT_DISAGGREGATED] = d.disaggregated_ttft_s
    tracing.record_span(
        ROUTER_MODE_DECISION,
        min(start_ns, end_ns),
        end_ns,
        attributes,
        trace.set_span_in_context(root) if root is not None else None,
    )


@contextmanager
def detached(name: str, link_to: trace.Span | None, key: RequestKey) -> Iterator[None]:
    """Run the block outside the request's trace, under a root span ``name`` (naming the
    request ``key``: the caller's id and tenant) of a trace of its own that links to
    ``link_to`` (the request's ``router.request``): for work that outlives the request's
    call, whose spans could not lie inside it. Use it inside a task of its own (it replaces
    that task's tracing context while the block runs)."""
    token = otel_context.attach(otel_context.Context())  # no parent, no baggage
    try:
        context = link_to.get_span_context() if link_to is not None else None
        links = [trace.Link(context)] if context is not None and context.is_valid else []
        tracer = trace.get_tracer(_INSTRUMENTATION_NAME)
        attributes = {ATTR_REQUEST_ID: key.request_id, ATTR_TENANT: key.tenant}
        with tracer.start_as_current_span(name, links=links, attributes=attributes):
            yield
    finally:
        otel_context.detach(token)


def name_mode(root: trace.Span | None, mode: common_pb2.Mode) -> None:
    """Name the serving mode the request got on its ``router.request`` span."""
    if root is not None:
        root.set_attribute(ATTR_MODE, MODE_NAMES.get(mode, "unspecified"))


@dataclass(slots=True)
class ObservedRequest:
    """One request in flight: its root span and when its tokens arrived (``perf_counter``)."""

    span: trace.Span
    metrics: RouterMetrics | None
    accepted_ns: int = field(default_factory=time.time_ns)
    """When the request arrived (Unix ns): the span's start."""
    started: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    tokens: int = 0
    finished_after_s: float | None = None
    arm: str = ""
    """The request's rollout arm, once the flow chose it ("" when no split is set)."""
    prompt_tokens: int = 0
    finish_reason: FinishReason | None = None

    def prepared(self, route: RouteRequest) -> None:
        """The request is validated and tokenized: name it on the span."""
        self.prompt_tokens = len(route.prompt_token_ids)
        self.span.set_attributes(
            {ATTR_REQUEST_ID: route.request_id, ATTR_PROMPT_TOKENS: self.prompt_tokens}
        )

    def chunk(self, chunk: RouteChunk) -> None:
        """A chunk from the flow: the first token's arrival is the TTFT; each later token
        adds one inter-token gap (a chunk of k tokens spreads its gap evenly over them)."""
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        n = len(chunk.token_ids)
        if n == 0:
            return
        now = time.perf_counter()
        if self.metrics is not None:
            if self.last_token_at is None:
                self.metrics.observe_ttft(now - self.started, arm=self.arm)
                later = n - 1  # the chunk's first token was the first token
                gap = 0.0
            else:
                later = n
                gap = (now - self.last_token_at) / n
            for _ in range(later):
                self.metrics.observe_itl(gap, arm=self.arm)
        self.last_token_at = now
        self.tokens += n

    def finish(self) -> None:
        """The last chunk is out: end to end ends here (idempotent)."""
        if self.finished_after_s is None:
            self.finished_after_s = time.perf_counter() - self.started
            self.span.end()


class RouterTelemetry:
    """Spans and metrics of the router's requests; ``metrics`` None records spans only."""

    def __init__(
        self,
        metrics: RouterMetrics | None = None,
        *,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.metrics = metrics
        # Without an SDK provider the API's no-op one hands out non-recording spans.
        provider = tracer_provider or trace.get_tracer_provider()
        self._tracer = provider.get_tracer(_INSTRUMENTATION_NAME)

    @contextmanager
    def request(self, tenant: str) -> Iterator[ObservedRequest]:
        """The ``with`` body is one request; see the module docstring."""
        accepted_ns = time.time_ns()
        span = self._tracer.start_span(
            ROUTER_REQUEST, attributes={ATTR_TENANT: tenant}, start_time=accepted_ns
        )
        observed = ObservedRequest(span, self.metrics, accepted_ns)
        outcome = OUTCOME_ERROR
        try:
            yield observed
            outcome = OUTCOME_OK
        except (asyncio.CancelledError, GeneratorExit) as err:
            outcome = OUTCOME_CANCELLED
            span.set_status(Status(StatusCode.ERROR, f"cancelled: {type(err).__name__}"))
            raise
        except Exception as err:
            span.record_exception(err)
            span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err}"))
            raise
        finally:
            observed.finish()
            if self.metrics is not None:
                reason = FinishReason.ABORT if outcome == OUTCOME_CANCELLED else None
                if outcome == OUTCOME_OK:
                    reason = observed.finish_reason
                if reason is not None and observed.finished_after_s is not None:
                    self.metrics.observe_finished(
                        observed.finished_after_s,
                        prompt_tokens=observed.prompt_tokens,
                        generated=observed.tokens,
                        reason=reason.value,
                    )
                self.metrics.count_request(outcome)
                if observed.arm:
                    self.metrics.count_arm(observed.arm, outcome)
