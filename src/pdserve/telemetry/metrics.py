"""Prometheus metrics of the services, each service with its own registry, and ``/metrics``.

Services use the typed helpers (``RouterMetrics``, ``WorkerMetrics``, ``SchedulerMetrics``)
and never prometheus-client itself. Each helper owns a fresh ``CollectorRegistry`` unless given
one, so two services in one process (tests, a colocated launcher) never share or collide in
prometheus-client's process-wide default registry. Metric names are the constants here (the
host lease's in ``lease_metrics``) and in ``docs/observability.md``; the Grafana dashboard
queries them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.lease_metrics import LeaseMetrics
from pdserve.telemetry.vllm_metrics import VllmEngineMetrics, VllmRequestMetrics

TTFT_SECONDS = "pdserve_ttft_seconds"
ITL_SECONDS = "pdserve_inter_token_latency_seconds"
E2E_SECONDS = "pdserve_e2e_latency_seconds"
REQUESTS_TOTAL = "pdserve_requests"  # a Counter: exposed as pdserve_requests_total
QUEUE_DEPTH = "pdserve_queue_depth"
KV_BLOCKS_FREE = "pdserve_kv_blocks_free"
KV_BLOCKS_TOTAL = "pdserve_kv_blocks_total"
TRANSFER_BYTES = "pdserve_kv_transfer_bytes"  # Counter: ..._total
TRANSFER_SECONDS = "pdserve_kv_transfer_seconds"
HANDOFFS = "pdserve_kv_handoffs"  # Counter: ..._total
SCHEDULER_DECISIONS = "pdserve_scheduler_decisions"  # Counter: ..._total
SCHEDULER_CONFLICTS = "pdserve_scheduler_conflicts"  # Counter: ..._total
SCHEDULER_MODES = "pdserve_scheduler_mode_decisions"  # Counter: ..._total
ARM_REQUESTS = "pdserve_arm_requests"  # Counter: ..._total
ARM_TTFT_SECONDS = "pdserve_arm_ttft_seconds"
ARM_ITL_SECONDS = "pdserve_arm_inter_token_latency_seconds"
PLANNER_MOVES = "pdserve_planner_moves"  # Counter: ..._total
PLANNER_PRESSURE = "pdserve_planner_pressure"
PLANNER_LEADER = "pdserve_planner_leader"
REDIS_ERRORS = "pdserve_redis_errors"  # Counter: ..._total
HTTP_REQUESTS = "pdserve_http_requests"  # Counter: ..._total
HTTP_SECONDS = "pdserve_http_request_seconds"
ENGINE_FAILURES = "pdserve_engine_failures"  # Counter: ..._total
SCHEDULER_WAITING = "pdserve_router_scheduler_waiting"
SCHEDULER_WAIT_SECONDS = "pdserve_router_scheduler_wait_seconds"
LINK_RATE = "pdserve_kv_transfer_bytes_per_second"
LINK_PEAK = "pdserve_kv_transfer_peak_bytes_per_second"
LINK_CAPACITY = "pdserve_kv_link_capacity_bytes_per_second"

# Bucket upper bounds in seconds. TTFT spans a short prompt on an idle cluster (ms) to a long
# prompt behind a queue (s); inter-token latency is one decode step (ms).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

TRANSFER_DIRECTIONS = ("send", "recv")
ENGINE_FAILURE_KINDS = ("step", "request")


def _label(field: str, value: str) -> str:
    if not value:
        raise InvalidArgumentError(field, "label value must be non-empty")
    return value


def _non_negative(field: str, value: float) -> float:
    if not value >= 0:  # also rejects NaN
        raise InvalidArgumentError(field, f"must be >= 0, got {value}")
    return value


def _registry(registry: CollectorRegistry | None, process: bool) -> CollectorRegistry:
    if registry is not None:
        return registry
    registry = CollectorRegistry()
    if process:  # CPU seconds, resident memory, open fds of this service's process
        ProcessCollector(registry=registry)
    return registry


class RouterMetrics:
    """Client-visible latency, measured by the router: TTFT, inter-token, end to end."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        process: bool = True,
        model_name: str = "pdserve",
    ) -> None:
        """``model_name``: the label of the vLLM-named families (``vllm_metrics``)."""
        self.registry = _registry(registry, process)
        r = self.registry
        self.vllm = VllmRequestMetrics(r, _label("model_name", model_name))
        self._ttft = Histogram(
            TTFT_SECONDS,
            "Time to first token seen by the router.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._itl = Histogram(
            ITL_SECONDS,
            "Time between consecutive streamed tokens.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            E2E_SECONDS, "Request accepted to last token sent.", buckets=E2E_BUCKETS, registry=r
        )
        self._requests = Counter(
            REQUESTS_TOTAL, "Finished requests by outcome.", ["outcome"], registry=r
        )
        # Per rollout arm (the serving mode a request was sent to: docs/scheduling.md).
        self._arm_requests = Counter(
            ARM_REQUESTS, "Finished requests by rollout arm and outcome.", ["arm", "outcome"],
            registry=r,
        )  # fmt: skip
        self._arm_ttft = Histogram(
            ARM_TTFT_SECONDS, "Time to first token by rollout arm.", ["arm"],
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self._arm_itl = Histogram(
            ARM_ITL_SECONDS, "Time between streamed tokens by rollout arm.", ["arm"],
            buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        # Placements that waited for a scheduler (restarting, or full during a failover).
        self._waiting = Gauge(
            SCHEDULER_WAITING, "Requests waiting for a scheduler now.", registry=r
        )
        self._waited = Histogram(
            SCHEDULER_WAIT_SECONDS, "Time a placement waited for a scheduler, by cause.",
            ["cause"], buckets=WAIT_BUCKETS, registry=r,
        )  # fmt: skip

    def observe_ttft(self, seconds: float, *, arm: str = "") -> None:
        self._ttft.observe(_non_negative("seconds", seconds))
        self.vllm.ttft(seconds)
        if arm:
            self._arm_ttft.labels(arm=arm).observe(seconds)

    def observe_itl(self, seconds: float, *, arm: str = "") -> None:
        self._itl.observe(_non_negative("seconds", seconds))
        self.vllm.itl(seconds)
        if arm:
            self._arm_itl.labels(arm=arm).observe(seconds)

    def count_arm(self, arm: str, outcome: str) -> None:
        """One finished request of rollout arm ``arm``."""
        self._arm_requests.labels(arm=_label("arm", arm), outcome=_label("outcome", outcome)).inc()

    def observe_finished(
        self, seconds: float, *, prompt_tokens: int, generated: int, reason: str
    ) -> None:
        """A request served to its end: end to end, its tokens, why it finished."""
        self._e2e.observe(_non_negative("seconds", seconds))
        self.vllm.finished(seconds, prompt_tokens, generated, _label("reason", reason))

    def count_request(self, outcome: str) -> None:
        """One finished request; ``outcome`` is a short fixed word (ok, error, cancelled...)."""
        self._requests.labels(outcome=_label("outcome", outcome)).inc()

    def scheduler_wait_began(self) -> None:
        """A placement found no scheduler to take it and waits (``router.scheduler_wait``)."""
        self._waiting.inc()

    def scheduler_wait_ended(self, cause: str, seconds: float) -> None:
        """That wait ended (placed, failed or cancelled) after ``seconds``; ``cause``:
        ``unavailable`` or ``full``."""
        self._waiting.dec()
        self._waited.labels(cause=_label("cause", cause)).observe(_non_negative("seconds", seconds))


class WorkerMetrics:
    """A prefill, decode or colocated worker: queue depth, free KV blocks, KV transfers."""

    def __init__(
        self,
        role: str,
        registry: CollectorRegistry | None = None,
        *,
        process: bool = True,
        model_name: str | None = None,
    ) -> None:
        """``model_name``: the served model, for the vLLM-named families of an engine's
        worker (``vllm_metrics``); None (a KV store): none."""
        self.role = _label("role", role)
        self.registry = _registry(registry, process)
        r = self.registry
        self.vllm = None if model_name is None else VllmEngineMetrics(r, model_name)
        self._queue = Gauge(
            QUEUE_DEPTH, "Requests waiting in the engine queue.", ["role"], registry=r
        )
        self._free = Gauge(KV_BLOCKS_FREE, "Free paged-KV blocks.", ["role"], registry=r)
        self._total = Gauge(KV_BLOCKS_TOTAL, "Paged-KV blocks in the pool.", ["role"], registry=r)
        self._bytes = Counter(
            TRANSFER_BYTES, "KV bytes moved.", ["transport", "direction"], registry=r
        )
        self._seconds = Histogram(
            TRANSFER_SECONDS,
            "Duration of one KV transfer.",
            ["transport", "direction"],
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self._handoffs = Counter(
            HANDOFFS,
            "KV hand-offs by the transport that carried them (recompute: none; the decode "
            "worker prefilled) and outcome (fallback: the chosen transport failed or timed out).",
            ["transport", "direction", "outcome"],
            registry=r,
        )
        self._redis_errors = Counter(
            REDIS_ERRORS, "Failed Redis operations.", ["operation"], registry=r
        )
        self._engine_failures = Counter(
            ENGINE_FAILURES,
            "Engine steps that failed some of their requests, and the requests they failed.",
            ["kind"],
            registry=r,
        )
        self.lease = LeaseMetrics(r)
        """The host lease's families (``pdserve.compute``)."""
        # Live KV link bandwidth (``transfer.bandwidth``), set at scrape time.
        link_labels = ["link", "transport", "direction", "window"]
        self._link_rate = Gauge(
            LINK_RATE, "KV bytes/s per link over the last 10 s.", link_labels, registry=r
        )
        self._link_peak = Gauge(
            LINK_PEAK, "Busiest 100 ms of KV bytes/s per link within the last 10 s.",
            link_labels, registry=r,
        )  # fmt: skip
        self._link_capacity = Gauge(
            LINK_CAPACITY, "A KV link's bytes/s as measured by its hand-offs (else the prior).",
            ["link", "transport"], registry=r,
        )  # fmt: skip

    def set_queue_depth(self, depth: int, *, role: str | None = None) -> None:
        """The queue length now; ``role`` overrides the worker's (a colocated worker has two)."""
        role = self.role if role is None else _label("role", role)
        self._queue.labels(role=role).set(_non_negative("depth", depth))

    def set_engine_load(self, *, running: int, waiting: int, free: int, total: int) -> None:
        """The engine's load now: the queue and KV gauges, and vLLM's."""
        self.set_queue_depth(waiting)
        self.set_kv_blocks(free, total)
        if self.vllm is not None:
            self.vllm.load(running=running, waiting=waiting, blocks_free=free, blocks_total=total)

    def set_kv_blocks(self, free: int, total: int | None = None) -> None:
        self._free.labels(role=self.role).set(_non_negative("free", free))
        if total is not None:
            if total < free:
                raise InvalidArgumentError("total", f"{total} is below free {free}")
            self._total.labels(role=self.role).set(total)

    def observe_transfer(self, transport: str, direction: str, nbytes: int, seconds: float) -> None:
        """One finished KV transfer of ``nbytes`` over ``transport`` taking ``seconds``."""
        if direction not in TRANSFER_DIRECTIONS:
            raise InvalidArgumentError("direction", f"must be one of {TRANSFER_DIRECTIONS}")
        labels = {"transport": _label("transport", transport), "direction": direction}
        self._bytes.labels(**labels).inc(_non_negative("nbytes", nbytes))
        self._seconds.labels(**labels).observe(_non_negative("seconds", seconds))

    def set_link_rate(
        self, link: str, transport: str, direction: str, *, average_bps: float, peak_bps: float
    ) -> None:
        """One link's live bytes/s: the 10 s average and the 100 ms peak within it."""
        if direction not in TRANSFER_DIRECTIONS:
            raise InvalidArgumentError("direction", f"must be one of {TRANSFER_DIRECTIONS}")
        labels = {"link": _label("link", link), "transport": _label("transport", transport)}
        self._link_rate.labels(**labels, direction=direction, window="10s").set(
            _non_negative("average_bps", average_bps)
        )
        self._link_peak.labels(**labels, direction=direction, window="100ms").set(
            _non_negative("peak_bps", peak_bps)
        )

    def set_link_capacity(self, link: str, transport: str, bytes_per_s: float) -> None:
        """What the link model believes ``(link, transport)`` carries, bytes/s."""
        self._link_capacity.labels(
            link=_label("link", link), transport=_label("transport", transport)
        ).set(_non_negative("bytes_per_s", bytes_per_s))

    def count_handoff(self, transport: str, direction: str, *, fallback: bool) -> None:
        """One side of a KV hand-off finished over ``transport``; ``fallback`` when it is not
        the transport first chosen (that one failed or timed out)."""
        if direction not in TRANSFER_DIRECTIONS:
            raise InvalidArgumentError("direction", f"must be one of {TRANSFER_DIRECTIONS}")
        self._handoffs.labels(
            transport=_label("transport", transport),
            direction=direction,
            outcome="fallback" if fallback else "ok",
        ).inc()

    def count_redis_error(self, operation: str) -> None:
        self._redis_errors.labels(operation=_label("operation", operation)).inc()

    def count_engine_failures(self, kind: str, n: int = 1) -> None:
        """Engine steps (``kind="step"``) or requests (``"request"``) that failed, ``n`` more."""
        if kind not in ENGINE_FAILURE_KINDS:
            raise InvalidArgumentError("kind", f"must be one of {ENGINE_FAILURE_KINDS}")
        self._engine_failures.labels(kind=kind).inc(_non_negative("n", n))


class SchedulerMetrics:
    """The scheduler: placement decisions, optimistic-check conflicts, Redis errors."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = _registry(registry, process)
        r = self.registry
        self._decisions = Counter(
            SCHEDULER_DECISIONS, "Assign calls by policy and outcome.", ["policy", "outcome"],
            registry=r,
        )  # fmt: skip
        self._conflicts = Counter(
            SCHEDULER_CONFLICTS,
            "Optimistic re-checks that found the chosen worker changed (then retried).",
            registry=r,
        )
        self._modes = Counter(
            SCHEDULER_MODES, "Assignments by the mode chosen and why.", ["mode", "reason"],
            registry=r,
        )  # fmt: skip
        self._redis_errors = Counter(
            REDIS_ERRORS, "Failed Redis operations.", ["operation"], registry=r
        )

    def count_decision(self, policy: str, outcome: str) -> None:
        """One ``Assign`` answered; ``outcome`` e.g. assigned, no_capacity."""
        self._decisions.labels(
            policy=_label("policy", policy), outcome=_label("outcome", outcome)
        ).inc()

    def count_conflict(self, n: int = 1) -> None:
        self._conflicts.inc(_non_negative("n", n))

    def count_mode(self, mode: str, reason: str) -> None:
        """One assignment in ``mode`` for ``reason`` (``placement.Reason``)."""
        self._modes.labels(mode=_label("mode", mode), reason=_label("reason", reason)).inc()

    def count_redis_error(self, operation: str) -> None:
        self._redis_errors.labels(operation=_label("operation", operation)).inc()


class GatewayMetrics:
    """The HTTP gateway: answered requests by route and status, and how long each took
    (a stream: until its last event)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = _registry(registry, process)
        r = self.registry
        self._requests = Counter(
            HTTP_REQUESTS, "HTTP requests answered, by route and status.", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self._seconds = Histogram(
            HTTP_SECONDS, "HTTP request to the last byte of its answer.", ["route"],
            buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        """One answered request; ``route`` is a fixed path (never one with ids in it)."""
        route = _label("route", route)
        self._requests.labels(route=route, status=str(status)).inc()
        self._seconds.labels(route=route).observe(_non_negative("seconds", seconds))


class PlannerMetrics:
    """The P:D planner: the pressures it sees, the moves it orders, whether it leads."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = _registry(registry, process)
        r = self.registry
        self._moves = Counter(
            PLANNER_MOVES, "Duty moves ordered, by new duty and reason.", ["duty", "reason"],
            registry=r,
        )  # fmt: skip
        self._pressure = Gauge(
            PLANNER_PRESSURE, "Load against the SLOs per side (1: at the SLO).", ["side"],
            registry=r,
        )  # fmt: skip
        self._leader = Gauge(PLANNER_LEADER, "1 while this replica leads.", registry=r)

    def count_move(self, duty: str, reason: str) -> None:
        self._moves.labels(duty=_label("duty", duty), reason=_label("reason", reason)).inc()

    def set_pressure(self, prefill: float, decode: float) -> None:
        self._pressure.labels(side="prefill").set(_non_negative("prefill", prefill))
        self._pressure.labels(side="decode").set(_non_negative("decode", decode))

    def set_leader(self, leading: bool) -> None:
        self._leader.set(1 if leading else 0)
