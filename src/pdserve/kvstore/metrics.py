"""The KV store's Prometheus metrics, from ``KVStore.stats()`` snapshots.

``StoreCollector`` registers into any ``CollectorRegistry`` (the KV store service's). The store
is not thread-safe and a scrape runs on the metrics server's thread, so the store's own event
loop ``publish``es a snapshot (the service does it from its sweep, every second) and a scrape
reads the latest one. Families (counters carry ``_total``):

=====================================  =======  ============================================
``pdserve_kvstore_bytes{tier}``        gauge    bytes held in ``ram`` (reservations of writes
                                                in progress included) and on ``disk``
``pdserve_kvstore_capacity_bytes``     gauge    the budget of each tier
``pdserve_kvstore_entries{kind}``      gauge    live entries: ``handoff``, ``cache``; and
                                                ``on_disk``, ``pinned``, ``writing``
``pdserve_kvstore_hit_ratio``          gauge    reads that found their key, over all reads
``pdserve_kvstore_transfer_bytes``     counter  ``{direction}`` ``in`` (committed writes) and
                                                ``out`` (reads): rate() is the bandwidth
``pdserve_kvstore_events{event}``      counter  ``hit``, ``miss``, ``expired``, ``spill``,
                                                ``reload``, ``eviction``, ``lookup``,
                                                ``lookup_hit``
=====================================  =======  ============================================
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.kvstore.stats import StoreStats

PREFIX = "pdserve_kvstore"


class StoreCollector(Collector):
    """Exports a KV store's totals and counters (see the module docstring)."""

    def __init__(self) -> None:
        self._latest: StoreStats | None = None

    def publish(self, stats: StoreStats) -> None:
        """The store's state now (call it on the store's thread)."""
        self._latest = stats  # one reference swap: a scrape sees the old or the new one

    def collect(self) -> Iterable[Metric]:
        s = self._latest
        if s is None:
            return []
        held = GaugeMetricFamily(f"{PREFIX}_bytes", "Bytes held per tier.", labels=["tier"])
        held.add_metric(["ram"], s.used_bytes)
        held.add_metric(["disk"], s.disk_used_bytes)
        budget = GaugeMetricFamily(
            f"{PREFIX}_capacity_bytes", "Byte budget per tier (0: no such tier).", labels=["tier"]
        )
        budget.add_metric(["ram"], s.capacity_bytes)
        budget.add_metric(["disk"], s.disk_capacity_bytes)
        entries = GaugeMetricFamily(f"{PREFIX}_entries", "Live entries.", labels=["kind"])
        for kind, value in (
            ("handoff", s.num_entries - s.num_cache_entries),
            ("cache", s.num_cache_entries),
            ("on_disk", s.num_disk_entries),
            ("pinned", s.num_pinned),
            ("writing", s.num_writing),
        ):
            entries.add_metric([kind], value)
        ratio = GaugeMetricFamily(f"{PREFIX}_hit_ratio", "Reads that found their key.")
        ratio.add_metric([], s.hit_rate)
        moved = CounterMetricFamily(
            f"{PREFIX}_transfer_bytes", "Bytes written and read.", labels=["direction"]
        )
        moved.add_metric(["in"], s.bytes_in)
        moved.add_metric(["out"], s.bytes_out)
        events = CounterMetricFamily(f"{PREFIX}_events", "Store events.", labels=["event"])
        for event, value in (
            ("hit", s.hits),
            ("miss", s.misses),
            ("expired", s.expired),
            ("spill", s.spills),
            ("reload", s.reloads),
            ("eviction", s.evictions),
            ("lookup", s.lookups),
            ("lookup_hit", s.lookup_hits),
        ):
            events.add_metric([event], value)
        return [held, budget, entries, ratio, moved, events]
