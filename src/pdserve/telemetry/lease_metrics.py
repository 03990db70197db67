"""The host lease's metrics: how a worker's engine steps shared the host's cores.

Owns the ``pdserve_core_*`` families and turns the lease's running totals
(``pdserve.compute.LeaseStats``, read at scrape time) into counter increments. Apart from
``WorkerMetrics`` because it is one record with its own bookkeeping (the totals seen last),
registered in the worker's registry like ``vllm_metrics``'s families.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

CORE_STEPS = "pdserve_core_steps"  # Counter: ..._total
CORE_WAIT_SECONDS = "pdserve_core_wait_seconds"  # Counter: ..._total
CORE_PACED_SECONDS = "pdserve_core_paced_seconds"  # Counter: ..._total
CORE_LENT_SECONDS = "pdserve_core_lent_seconds"  # Counter: ..._total
CORE_SPLITS = "pdserve_core_splits"  # Counter: ..._total


class LeaseMetrics:
    """The lease's families in ``registry``: running totals, advanced by what changed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self._steps = Counter(
            CORE_STEPS, "Engine steps run under the host lease.", ["kind"], registry=r
        )
        self._wait = Counter(
            CORE_WAIT_SECONDS, "Time engine steps waited for the host's cores.", ["kind"],
            registry=r,
        )  # fmt: skip
        self._paced = Counter(
            CORE_PACED_SECONDS, "Time decode steps were held back for waiting prefills.",
            registry=r,
        )  # fmt: skip
        self._lent = Counter(
            CORE_LENT_SECONDS, "Time long prefill steps lent the cores to decode steps.",
            registry=r,
        )  # fmt: skip
        self._splits = Counter(
            CORE_SPLITS, "Times a long prefill step ran beside decode steps on its share of "
            "the threads.", registry=r,
        )  # fmt: skip
        self._seen: tuple[float, ...] = (0,) * 7

    def record(
        self,
        *,
        interactive_steps: int,
        bulk_steps: int,
        interactive_wait_s: float,
        bulk_wait_s: float,
        paced_s: float,
        lent_s: float,
        splits: int,
    ) -> None:
        """The host lease's running totals now (``pdserve.compute.LeaseStats``)."""
        now = (
            interactive_steps, bulk_steps, interactive_wait_s, bulk_wait_s, paced_s, lent_s,
            splits,
        )  # fmt: skip
        d = [max(0.0, a - b) for a, b in zip(now, self._seen, strict=True)]
        self._seen = now
        self._steps.labels(kind="interactive").inc(d[0])
        self._steps.labels(kind="bulk").inc(d[1])
        self._wait.labels(kind="interactive").inc(d[2])
        self._wait.labels(kind="bulk").inc(d[3])
        self._paced.inc(d[4])
        self._lent.inc(d[5])
        self._splits.inc(d[6])
