"""The stable span names and attribute keys of pdserve's request path.

These strings are an interface: dashboards, saved Jaeger queries and ``pdserve trace report``
match on them, so change them only together with ``docs/observability.md``. Attribute keys
share the ``pdserve.`` prefix so that they never collide with the OpenTelemetry semantic
conventions (``rpc.*``, ``net.*``) that the gRPC instrumentation sets on its own spans.

One request is one trace. ``router.request`` is its root stage and measures end to end; every
other stage below is a descendant of it, recorded by the service that did the work. Decode
steps get no span each (a 500-token answer would make 500 spans); ``decode.generate``
summarises them with the inter-token latency mean and maximum instead.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- service names (``init_tracing(SERVICE_ROUTER)``; the ``service.name`` resource) --------

SERVICE_ROUTER = "pdserve-router"
SERVICE_SCHEDULER = "pdserve-scheduler"
SERVICE_PREFILL = "pdserve-prefill"
SERVICE_DECODE = "pdserve-decode"
SERVICE_KVSTORE = "pdserve-kvstore"
SERVICE_PLANNER = "pdserve-planner"

# --- span names, in request-path order ----------------------------------------------------

ROUTER_REQUEST = "router.request"
ROUTER_MODE_DECISION = "router.mode_decision"
SCHEDULER_ASSIGN = "scheduler.assign"
PREFILL_QUEUE = "prefill.queue"
PREFILL_COMPUTE = "prefill.compute"
KV_TRANSFER_SEND = "kv.transfer.send"
KV_TRANSFER_RECV = "kv.transfer.recv"
DECODE_QUEUE = "decode.queue"
DECODE_FIRST_TOKEN = "decode.first_token"
DECODE_GENERATE = "decode.generate"
ROUTER_RELEASE = "router.release"
"""Not a stage: the release of a finished request's reservation, after the request's call
ended, as the root of a trace of its own linked to the request's ``router.request``."""
ROUTER_SCHEDULER_WAIT = "router.scheduler_wait"
"""Not a span: an event on ``router.request`` (or ``router.release``) saying that a call to
the scheduler waited for one to answer or to have room (``ATTR_WAIT_*``)."""

# --- attribute keys -----------------------------------------------------------------------

ATTR_REQUEST_ID = "pdserve.request_id"
ATTR_TENANT = "pdserve.tenant"
ATTR_PROMPT_TOKENS = "pdserve.prompt_tokens"
ATTR_MODE = "pdserve.mode"
ATTR_MODE_REASON = "pdserve.mode_reason"
ATTR_ARM = "pdserve.arm"
ATTR_LONG_PROMPT = "pdserve.long_prompt"
ATTR_TTFT_COLOCATED = "pdserve.predicted_ttft_colocated_s"
ATTR_TTFT_DISAGGREGATED = "pdserve.predicted_ttft_disaggregated_s"
ATTR_STALL_MS = "pdserve.stall_ms"

ATTR_POLICY = "pdserve.policy"
ATTR_CANDIDATES = "pdserve.candidates"
ATTR_RETRIES = "pdserve.retries"
ATTR_PREFILL_WORKER = "pdserve.prefill_worker"
ATTR_DECODE_WORKER = "pdserve.decode_worker"

ATTR_BATCH_SIZE = "pdserve.batch_size"
ATTR_TOKENS = "pdserve.tokens"
ATTR_PREFIX_HIT_TOKENS = "pdserve.prefix_hit_tokens"

ATTR_TRANSPORT = "pdserve.transport"
ATTR_BYTES = "pdserve.bytes"
ATTR_BANDWIDTH_MBPS = "pdserve.bandwidth_MBps"
ATTR_OVERLAP_MS = "pdserve.overlap_ms"
ATTR_FALLBACK = "pdserve.fallback"

ATTR_WAIT_CAUSE = "pdserve.wait_cause"
ATTR_WAIT_MS = "pdserve.wait_ms"
ATTR_WAIT_TRIES = "pdserve.wait_tries"
ATTR_WAIT_OUTCOME = "pdserve.wait_outcome"
ATTR_WAIT_STEP = "pdserve.wait_step"

ATTR_ITL_MEAN_MS = "pdserve.itl_mean_ms"
ATTR_ITL_MAX_MS = "pdserve.itl_max_ms"


@dataclass(frozen=True, slots=True)
class SpanSpec:
    """One stage span: its name, who records it, what it measures, and its attribute keys."""

    name: str
    service: str
    measures: str
    attributes: tuple[str, ...]


_TRANSFER_ATTRS = (ATTR_TRANSPORT, ATTR_BYTES, ATTR_BANDWIDTH_MBPS, ATTR_OVERLAP_MS, ATTR_FALLBACK)

SPANS: tuple[SpanSpec, ...] = (
    SpanSpec(
        ROUTER_REQUEST,
        SERVICE_ROUTER,
        "end to end: the router accepting the request to its last chunk being sent",
        (ATTR_REQUEST_ID, ATTR_TENANT, ATTR_PROMPT_TOKENS, ATTR_MODE),
    ),
    SpanSpec(
        ROUTER_MODE_DECISION,
        SERVICE_ROUTER,
        "the router's part before placement (validation, tokenization, the rollout arm); its "
        "attributes name the mode the request got and the cost model's inputs",
        (
            ATTR_MODE,
            ATTR_MODE_REASON,
            ATTR_PROMPT_TOKENS,
            ATTR_ARM,
            ATTR_LONG_PROMPT,
            ATTR_TTFT_COLOCATED,
            ATTR_TTFT_DISAGGREGATED,
            ATTR_PREFIX_HIT_TOKENS,
            ATTR_STALL_MS,
        ),
    ),
    SpanSpec(
        SCHEDULER_ASSIGN,
        SERVICE_SCHEDULER,
        "picking a prefill and a decode worker, optimistic re-check retries included",
        (
            ATTR_POLICY,
            ATTR_CANDIDATES,
            ATTR_RETRIES,
            ATTR_PREFILL_WORKER,
            ATTR_DECODE_WORKER,
            ATTR_MODE,
            ATTR_MODE_REASON,
        ),
    ),
    SpanSpec(
        PREFILL_QUEUE,
        SERVICE_PREFILL,
        "waiting in the prefill engine's queue until the request's batch starts",
        (ATTR_REQUEST_ID, ATTR_TENANT),
    ),
    SpanSpec(
        PREFILL_COMPUTE,
        SERVICE_PREFILL,
        "the prefill forward pass of the batch holding the request",
        (ATTR_BATCH_SIZE, ATTR_TOKENS, ATTR_PREFIX_HIT_TOKENS),
    ),
    SpanSpec(
        KV_TRANSFER_SEND,
        SERVICE_PREFILL,
        "shipping the request's KV blocks out of the prefill worker",
        _TRANSFER_ATTRS,
    ),
    SpanSpec(
        KV_TRANSFER_RECV,
        SERVICE_DECODE,
        "receiving and installing the KV blocks in the decode worker",
        _TRANSFER_ATTRS,
    ),
    SpanSpec(
        DECODE_QUEUE,
        SERVICE_DECODE,
        "waiting for a decode batch slot once the KV is installed",
        (ATTR_REQUEST_ID, ATTR_TENANT),
    ),
    SpanSpec(
        DECODE_FIRST_TOKEN,
        SERVICE_DECODE,
        "joining the running batch to the first generated token leaving the worker",
        (ATTR_REQUEST_ID, ATTR_TENANT),
    ),
    SpanSpec(
        DECODE_GENERATE,
        SERVICE_DECODE,
        "the first generated token to the last (all decode steps, one span)",
        (ATTR_TOKENS, ATTR_ITL_MEAN_MS, ATTR_ITL_MAX_MS),
    ),
)
"""Every stage span, in request-path order; ``router.request`` first."""

E2E_SPAN = ROUTER_REQUEST
"""The span whose duration is a request's end-to-end latency."""

STAGES: tuple[str, ...] = tuple(s.name for s in SPANS if s.name != E2E_SPAN)
"""The stages a latency breakdown splits a request into, in request-path order."""
