"""The same measurements under vLLM's metric names, so that dashboards, alerts and autoscalers
built for vLLM read a pdserve cluster unchanged.

Request-level families come from the router (it sees every request whole: first token, every
gap, the end), engine-level ones from each worker::

    router   vllm:time_to_first_token_seconds   histogram  {model_name}
             vllm:inter_token_latency_seconds   histogram  {model_name}
             vllm:e2e_request_latency_seconds   histogram  {model_name}
             vllm:prompt_tokens_total           counter    {model_name}
             vllm:generation_tokens_total       counter    {model_name}
             vllm:request_success_total         counter    {model_name, finished_reason}
    worker   vllm:num_requests_running          gauge      {model_name}
             vllm:num_requests_waiting          gauge      {model_name}
             vllm:kv_cache_usage_perc           gauge      {model_name}  (0..1)

Buckets are vLLM's, so histogram_quantile over a mixed fleet lines up. ``model_name`` is the
served model's name (the checkpoint directory's, as ``/v1/models`` lists it by default).
Summing a worker family over a pool gives the pool's figure, as it does over vLLM replicas.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"  # Counter: vllm:prompt_tokens_total
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"  # Counter: ..._total
VLLM_REQUEST_SUCCESS = "vllm:request_success"  # Counter: ..._total
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class VllmRequestMetrics:
    """The router's request-level families (module docstring)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, labels, buckets=buckets, registry=registry)
            return family.labels(model_name)

        self._ttft = histogram(VLLM_TTFT, "Histogram of time to first token in seconds.",
                               _TTFT_BUCKETS)  # fmt: skip
        self._itl = histogram(VLLM_ITL, "Histogram of inter-token latency in seconds.",
                              _ITL_BUCKETS)  # fmt: skip
        self._e2e = histogram(VLLM_E2E, "Histogram of end to end request latency in seconds.",
                              _E2E_BUCKETS)  # fmt: skip
        self._prompt = Counter(VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.",
                               labels, registry=registry).labels(model_name)  # fmt: skip
        self._generated = Counter(VLLM_GENERATION_TOKENS, "Number of generation tokens processed.",
                                  labels, registry=registry).labels(model_name)  # fmt: skip
        self._success = Counter(VLLM_REQUEST_SUCCESS, "Count of successfully processed requests.",
                                [*labels, "finished_reason"], registry=registry)  # fmt: skip
        self._model_name = model_name

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, seconds: float, prompt_tokens: int, generated: int, reason: str) -> None:
        """A request served to its end (``reason``: stop, length or abort, as vLLM's)."""
        self._e2e.observe(seconds)
        self._prompt.inc(prompt_tokens)
        self._generated.inc(generated)
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc()


class VllmEngineMetrics:
    """A worker's engine-level families (module docstring)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self._running = Gauge(VLLM_RUNNING, "Number of requests in model execution batches.",
                              labels, registry=registry).labels(model_name)  # fmt: skip
        self._waiting = Gauge(VLLM_WAITING, "Number of requests waiting to be processed.",
                              labels, registry=registry).labels(model_name)  # fmt: skip
        self._kv = Gauge(VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.",
                         labels, registry=registry).labels(model_name)  # fmt: skip

    def load(self, *, running: int, waiting: int, blocks_free: int, blocks_total: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)
        used = blocks_total - blocks_free
        self._kv.set(used / blocks_total if blocks_total > 0 else 0.0)
