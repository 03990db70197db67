"""A real cluster traces into a real OTLP receiver, and every service serves its metrics.

The receiver is an OTLP gRPC ``TraceService`` implemented here, on a loopback port. A
disaggregated cluster (router, scheduler, KV store, one prefill and one decode worker, each
its own process; run from ``cluster_driver.py``, see there why in a process of its own) is
pointed at it through the standard ``OTEL_*`` variables only, serves a few concurrent streaming
requests, has its ``/metrics`` scraped, and is stopped (which flushes every service's spans).
Then the spans must form, per request, exactly one connected trace (and one more for the
release of its reservation, after its call ended, linked to it): one root (the Router call's
SERVER span), every stage span present once, recorded by the service that did the work and a
child of ``router.request``, every span inside its parent, and the stages following each other
without a hole, so that together they cover the end-to-end time but for the last chunk's way
back through the router.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from cluster_driver import run_driver  # tests/integration is on sys.path
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pdserve.models.demo import init_checkpoint
from pdserve.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

# Span names and services as docs/observability.md documents them (not imported from the
# code under test).
ROOT_STAGE = "router.request"
STAGE_SERVICE = {
    "router.mode_decision": "pdserve-router",
    "scheduler.assign": "pdserve-scheduler",
    "prefill.queue": "pdserve-prefill",
    "prefill.compute": "pdserve-prefill",
    "kv.transfer.send": "pdserve-prefill",
    "kv.transfer.recv": "pdserve-decode",
    "decode.queue": "pdserve-decode",
    "decode.first_token": "pdserve-decode",
    "decode.generate": "pdserve-decode",
}
ROUTER_CALL = "/pdserve.v1.Router/Generate"
RELEASE_ROOT = "router.release"
"""A finished request's reservation is released after its call ended, in a trace of its own."""
RELEASE_CALL = "/pdserve.v1.Scheduler/Release"
TRANSPORT = "store"
"""Forced (``--transport store``): the KV goes through the KV store service, which then shows
in the traces and counts the same bytes as the workers; the choice never depends on timing.
Every hand-off is prefetched (``--kv-prefetch-min-bytes 0``), so the decode worker's follow
read of the store shows in the traces too, nested in its ``Prefetch`` call."""

KV_BLOCKS = 256
WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", str(KV_BLOCKS),
               "--heartbeat-interval-s", "0.2", "--transport", "store",
               "--kv-prefetch-min-bytes", "0")  # fmt: skip
PROMPTS = (
    "the quick brown fox",
    "a tale of two cities, it was the best of times",
    "one two three four five six seven eight nine ten eleven twelve",
    "hello",
)
MAX_TOKENS = (3, 6, 9, 12)
TENANT = "acme"
SLACK_NS = 50_000
"""Clock-conversion rounding allowed when checking that a span lies inside its parent, or
that a stage starts where the one before it ended."""


@dataclass(frozen=True)
class Received:
    """One exported span with its resource's service name."""

    service: str
    span: Span


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.lock = threading.Lock()

    def Export(  # noqa: N802 - the OTLP service's method name
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        batch: list[Received] = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    kv.value.string_value
                    for kv in resource_spans.resource.attributes
                    if kv.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                batch.extend(Received(service, s) for s in scope_spans.spans)
        with self.lock:
            self.spans.extend(batch)
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass(frozen=True)
class Run:
    """What the module's cluster produced: spans, streamed tokens, scraped metrics."""

    spans: list[Received]
    tokens: dict[str, list[int]]
    metrics: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]
    prompt_tokens: dict[str, int]
    worker_ids: dict[str, str]


def _attr(span: Span, key: str) -> object:
    for kv in span.attributes:
        if kv.key == key:
            value = kv.value
            return getattr(value, value.WhichOneof("value") or "string_value")
    return None


@contextlib.contextmanager
def _otlp_receiver() -> Iterator[tuple[_Receiver, int]]:
    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(None).wait()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    work = tmp_path_factory.mktemp("traced")
    model = init_checkpoint(work / "model", "tiny", dtype="float32", max_position_embeddings=256)
    tokenizer = Tokenizer.from_dir(model)
    with _otlp_receiver() as (receiver, port):
        # The cluster runs in a process of its own (see cluster_driver.py), pointed at the
        # receiver by standard variables only; anything the environment says is overridden.
        config = {
            "model": str(model),
            "worker_args": list(WORKER_ARGS),
            "otlp_endpoint": f"http://127.0.0.1:{port}",
            "env": {
                "OTEL_SDK_DISABLED": "false",
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_TRACES_SAMPLER": "always_on",
                # Export at shutdown only: no exporter thread competes with the requests.
                "OTEL_BSP_SCHEDULE_DELAY": "60000",
                "PDSERVE_SPAN_FILE": "",
            },
            "requests": [
                {"request_id": f"traced-{i}", "prompt": p, "max_tokens": n, "tenant": TENANT}
                for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
            ],
            "out": str(work / "out.json"),
        }
        seen = run_driver(config, work / "config.json")
        # The driver stopped the cluster: every service flushed its spans before exiting.
        with receiver.lock:
            spans = list(receiver.spans)
    metrics = {
        service: {(name, tuple(sorted(labels.items()))): value for name, labels, value in samples}
        for service, samples in seen["metrics"].items()
    }
    return Run(
        spans, seen["tokens"], metrics,
        {f"traced-{i}": len(tokenizer.encode(p)) for i, p in enumerate(PROMPTS)},
        seen["worker_ids"],
    )  # fmt: skip


def _by_trace(run: Run) -> list[list[Received]]:
    by_trace: dict[bytes, list[Received]] = defaultdict(list)
    for r in run.spans:
        by_trace[r.span.trace_id].append(r)
    return list(by_trace.values())


def _is_release(members: list[Received]) -> bool:
    return any(r.span.name == RELEASE_ROOT for r in members)


def _traces(run: Run) -> dict[str, list[Received]]:
    """request id -> the spans of its trace (not the release traces, ``_release_traces``)."""
    out: dict[str, list[Received]] = {}
    for members in _by_trace(run):
        if _is_release(members):
            continue
        roots = [r for r in members if r.span.name == ROOT_STAGE]
        assert len(roots) == 1, [r.span.name for r in members]
        rid = _attr(roots[0].span, "pdserve.request_id")
        assert isinstance(rid, str) and rid not in out
        out[rid] = members
    return out


def test_each_release_is_a_trace_of_its_own_linked_to_its_request(run: Run) -> None:
    requests = {
        rid: next(r.span for r in members if r.span.name == ROOT_STAGE)
        for rid, members in _traces(run).items()
    }
    released = []
    for members in filter(_is_release, _by_trace(run)):
        (root,) = [r for r in members if not r.span.parent_span_id]
        assert root.service == "pdserve-router" and root.span.name == RELEASE_ROOT
        rid = _attr(root.span, "pdserve.request_id")
        assert isinstance(rid, str) and rid in requests
        assert _attr(root.span, "pdserve.tenant") == TENANT
        # Linked to its request's root stage, in the request's own trace.
        (link,) = root.span.links
        assert (link.trace_id, link.span_id) == (
            requests[rid].trace_id,
            requests[rid].span_id,
        )
        # The Release call, both sides, inside the release span.
        calls = sorted((r.service, r.span.kind) for r in members if r.span.name == RELEASE_CALL)
        assert calls == [
            ("pdserve-router", Span.SPAN_KIND_CLIENT),
            ("pdserve-scheduler", Span.SPAN_KIND_SERVER),
        ], rid
        for r in members:
            assert (
                root.span.start_time_unix_nano - SLACK_NS
                <= r.span.start_time_unix_nano
                <= r.span.end_time_unix_nano
                <= root.span.end_time_unix_nano + SLACK_NS
            ), (rid, r.span.name)
        released.append(rid)
    assert sorted(released) == sorted(requests)  # one per finished request


def test_one_connected_trace_per_request(run: Run) -> None:
    traces = _traces(run)
    assert sorted(traces) == sorted(run.tokens)  # no other trace, none missing
    for rid, members in traces.items():
        by_id = {r.span.span_id: r for r in members}
        assert len(by_id) == len(members), rid
        roots = [r for r in members if not r.span.parent_span_id]
        assert len(roots) == 1, rid
        (root,) = roots
        assert root.service == "pdserve-router"
        assert root.span.name == ROUTER_CALL and root.span.kind == Span.SPAN_KIND_SERVER
        for r in members:
            if r is root:
                continue
            parent = by_id.get(r.span.parent_span_id)
            assert parent is not None, (rid, r.span.name)  # connected
            assert (
                parent.span.start_time_unix_nano - SLACK_NS
                <= r.span.start_time_unix_nano
                <= r.span.end_time_unix_nano
                <= parent.span.end_time_unix_nano + SLACK_NS
            ), (rid, r.span.name, parent.span.name)  # inside its parent
            if r.span.kind == Span.SPAN_KIND_SERVER:
                # A call's server side hangs off the same call's client side.
                assert parent.span.kind == Span.SPAN_KIND_CLIENT and parent.span.name == (
                    r.span.name
                ), (rid, r.span.name)


def test_every_stage_once_under_the_request_by_its_service(run: Run) -> None:
    decode_span_counts = set()
    for rid, members in _traces(run).items():
        (request,) = [r for r in members if r.span.name == ROOT_STAGE]
        (router_call,) = [r for r in members if not r.span.parent_span_id]
        assert request.span.parent_span_id == router_call.span.span_id
        stages = [r for r in members if r.span.name in STAGE_SERVICE]
        assert sorted(r.span.name for r in stages) == sorted(STAGE_SERVICE), rid
        for r in stages:
            assert r.service == STAGE_SERVICE[r.span.name], (rid, r.span.name)
            assert r.span.parent_span_id == request.span.span_id, (rid, r.span.name)
        # The prefill asks the decode worker which prefix blocks it holds only for prompts of
        # at least one whole block: that query's server span is not a decode step's.
        decode_span_counts.add(
            sum(
                r.service == "pdserve-decode" and not r.span.name.endswith("/CachedPrefix")
                for r in members
            )
        )
    # No span per decode step: 2 to 11 decode steps, the same spans.
    assert len(decode_span_counts) == 1, decode_span_counts


def test_stages_add_up_to_end_to_end(run: Run) -> None:
    for rid, members in _traces(run).items():
        (request,) = [r.span for r in members if r.span.name == ROOT_STAGE]
        e2e = request.end_time_unix_nano - request.start_time_unix_nano
        intervals = sorted(
            (r.span.start_time_unix_nano, r.span.end_time_unix_nano)
            for r in members
            if r.span.name in STAGE_SERVICE
        )
        # The path's order: each stage starts no earlier than the one before it.
        by_name = {r.span.name: r.span for r in members if r.span.name in STAGE_SERVICE}
        path = list(STAGE_SERVICE)
        starts = [by_name[name].start_time_unix_nano for name in path]
        send = path.index("kv.transfer.send")  # a layer-wise send may start in the compute
        assert starts[:send] == sorted(starts[:send]) and starts[send + 1 :] == sorted(
            starts[send + 1 :]
        ), rid
        # The stages tile the request from its start: each one starts where the time before
        # it was handed on (overlapping stages count once), never after a hole. What is left
        # is the last chunk's way from the decode worker through the router: after every
        # stage, inside the request (how long it takes is the machine's, not asserted).
        covered_to = request.start_time_unix_nano
        for start, stop in intervals:
            hole = start - covered_to
            assert hole <= SLACK_NS, (rid, f"{hole / 1e6:.3f} ms uncovered before a stage")
            covered_to = max(covered_to, stop)
        assert covered_to <= request.end_time_unix_nano + SLACK_NS, (rid, e2e / 1e6)


def test_stage_attributes(run: Run) -> None:
    for rid, members in _traces(run).items():
        spans = {r.span.name: r.span for r in members}
        i = int(rid.rsplit("-", 1)[1])
        request = spans[ROOT_STAGE]
        assert _attr(request, "pdserve.tenant") == TENANT
        assert _attr(request, "pdserve.prompt_tokens") == run.prompt_tokens[rid]
        assert _attr(request, "pdserve.mode") == "disaggregated"
        decision = spans["router.mode_decision"]
        assert _attr(decision, "pdserve.mode") == "disaggregated"
        assert _attr(decision, "pdserve.prompt_tokens") == run.prompt_tokens[rid]
        assign = spans["scheduler.assign"]
        assert _attr(assign, "pdserve.policy") == "kv_aware"
        assert _attr(assign, "pdserve.candidates") == 2  # one prefill, one decode worker
        retries = _attr(assign, "pdserve.retries")
        assert isinstance(retries, int) and retries >= 0
        assert _attr(assign, "pdserve.prefill_worker") == run.worker_ids["prefill"]
        assert _attr(assign, "pdserve.decode_worker") == run.worker_ids["decode"]
        for name in ("prefill.queue", "decode.queue", "decode.first_token"):
            # The caller's id and tenant, as on router.request (the workers got them scoped).
            assert _attr(spans[name], "pdserve.request_id") == rid, name
            assert _attr(spans[name], "pdserve.tenant") == TENANT, name
        compute = spans["prefill.compute"]
        assert 1 <= _attr(compute, "pdserve.batch_size") <= len(PROMPTS)  # type: ignore[operator]
        assert _attr(compute, "pdserve.tokens") == run.prompt_tokens[rid]
        assert _attr(compute, "pdserve.prefix_hit_tokens") == 0  # distinct prompts
        for name in ("kv.transfer.send", "kv.transfer.recv"):
            transfer = spans[name]
            assert _attr(transfer, "pdserve.transport") == TRANSPORT, name
            assert _attr(transfer, "pdserve.bytes") > 0, name  # type: ignore[operator]
            assert _attr(transfer, "pdserve.bandwidth_MBps") > 0, name  # type: ignore[operator]
            assert _attr(transfer, "pdserve.fallback") is False, name
        assert _attr(spans["kv.transfer.send"], "pdserve.bytes") == _attr(
            spans["kv.transfer.recv"], "pdserve.bytes"
        )
        generate = spans["decode.generate"]
        # The prefill made the first token; the decode worker the rest, one step each.
        decoded = MAX_TOKENS[i] - 1
        assert _attr(generate, "pdserve.tokens") == decoded
        mean, peak = _attr(generate, "pdserve.itl_mean_ms"), _attr(generate, "pdserve.itl_max_ms")
        assert isinstance(mean, float) and isinstance(peak, float)
        assert 0 < mean <= peak
        span_ms = (generate.end_time_unix_nano - generate.start_time_unix_nano) / 1e6
        assert mean * (decoded - 1) <= span_ms  # the gaps lie within the span


def _value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_metrics_of_every_service(run: Run) -> None:
    m = run.metrics
    assert sorted(m) == ["decode-0", "kvstore", "prefill-0", "router", "scheduler"]
    n = len(PROMPTS)
    tokens = [len(run.tokens[f"traced-{i}"]) for i in range(n)]
    assert tokens == list(MAX_TOKENS)  # ignore_eos: every request ran to max_tokens

    router = m["router"]
    assert _value(router, "pdserve_requests_total", outcome="ok") == n
    assert _value(router, "pdserve_ttft_seconds_count") == n
    assert _value(router, "pdserve_e2e_latency_seconds_count") == n
    assert _value(router, "pdserve_inter_token_latency_seconds_count") == sum(tokens) - n
    ttft, e2e = (
        _value(router, "pdserve_ttft_seconds_sum"),
        _value(router, "pdserve_e2e_latency_seconds_sum"),
    )
    assert 0 < ttft < e2e
    assert _value(router, "pdserve_inter_token_latency_seconds_sum") < e2e

    scheduler = m["scheduler"]
    assert (
        _value(
            scheduler,
            "pdserve_scheduler_decisions_total",
            policy="kv_aware",
            outcome="assigned",
        )
        == n
    )
    assert _value(scheduler, "pdserve_scheduler_conflicts_total") >= 0
    for name, samples in m.items():
        assert _total(samples, "pdserve_redis_errors_total") == 0, name
        assert _value(samples, "process_cpu_seconds_total") > 0, name

    for worker, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        w = m[worker]
        assert _value(w, "pdserve_queue_depth", role=role) == 0  # idle again
        assert _value(w, "pdserve_kv_blocks_total", role=role) == KV_BLOCKS
        assert _value(w, "pdserve_kv_blocks_free", role=role) == KV_BLOCKS  # all released

    sent, received = m["prefill-0"], m["decode-0"]
    assert _total(sent, "pdserve_kv_transfer_seconds_count") == n
    assert _total(received, "pdserve_kv_transfer_seconds_count") == n
    sent_bytes = _total(sent, "pdserve_kv_transfer_bytes_total")
    assert sent_bytes > 0 and sent_bytes == _total(received, "pdserve_kv_transfer_bytes_total")
    # The store counted the same bytes, in from the prefill and out to the decode worker.
    stored = _value(sent, "pdserve_kv_transfer_bytes_total", transport=TRANSPORT, direction="send")
    assert stored == sent_bytes
    store = m["kvstore"]
    assert (
        _value(store, "pdserve_kv_transfer_bytes_total", transport="store", direction="recv")
        == stored
    )
    assert (
        _value(store, "pdserve_kv_transfer_bytes_total", transport="store", direction="send")
        == stored
    )
