"""``BandwidthMeter``: live KV transfer bandwidth per (link, transport), average and peak.
Pure: no I/O, no tasks; the clock is injected. Torch-free.

Bursts, not averages, saturate a link, so the meter answers two figures over the last
``WINDOW_NS`` (10 s): the average bytes/s, and the peak bytes/s of any ``BUCKET_NS`` (100 ms)
bucket. Each transfer's bytes are spread evenly over its ``[start_ns, end_ns]`` (a transfer of
no duration: all in the bucket of its end) into a ring of ``BUCKETS`` buckets per key, so the
memory per link is fixed. Bucket ``i`` holds the bytes of ``[i * BUCKET_NS, (i + 1) *
BUCKET_NS)``; the window is the bucket of ``now`` and the ``BUCKETS - 1`` before it, and the
parts of a transfer outside it are left out (already expired, or stamped after ``now``).

Stamps are ``time.monotonic_ns`` (the default clock), as in ``HandoffRecord``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.record import HandoffRecord

BUCKET_NS = 100_000_000
"""One peak window: 100 ms."""
BUCKETS = 100
WINDOW_NS = BUCKET_NS * BUCKETS
"""The average's window, and how far back the peak looks: 10 s."""
SAME_HOST = "same-host"
"""The link of an ``shm`` hand-off (it never leaves the host)."""


@dataclass(frozen=True, slots=True)
class LinkRate:
    """One (link, transport)'s bytes/s over the last 10 s: ``average_bps`` and
    ``peak_bps`` (the busiest 100 ms bucket)."""

    link: str
    transport: str
    average_bps: float
    peak_bps: float


class _Ring:
    """``BUCKETS`` buckets of bytes, each tagged with the absolute bucket index it holds."""

    __slots__ = ("bytes", "index")

    def __init__(self) -> None:
        self.bytes = [0.0] * BUCKETS
        self.index = [-1] * BUCKETS

    def add(self, bucket: int, num_bytes: float) -> None:
        slot = bucket % BUCKETS
        if self.index[slot] != bucket:  # an expired bucket's slot: start it again
            self.index[slot], self.bytes[slot] = bucket, 0.0
        self.bytes[slot] += num_bytes

    def live(self, now_bucket: int) -> list[float]:
        """The bytes of the buckets inside the window ending at ``now_bucket``."""
        first = now_bucket - BUCKETS + 1
        return [b for b, i in zip(self.bytes, self.index, strict=True) if first <= i <= now_bucket]


class BandwidthMeter:
    """Live bytes/s per (link, transport): see the module docstring. ``clock``: now, in ns
    (``time.monotonic_ns``, the stamps' clock)."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock = clock
        self._rings: dict[tuple[str, str], _Ring] = {}

    def record(self, link: str, transport: str, num_bytes: int, start_ns: int, end_ns: int) -> None:
        """``num_bytes`` moved over ``(link, transport)`` from ``start_ns`` to ``end_ns``."""
        if not link:
            raise InvalidArgumentError("link", "must be non-empty")
        if not transport:
            raise InvalidArgumentError("transport", "must be non-empty")
        if num_bytes < 0:
            raise InvalidArgumentError("num_bytes", f"must be >= 0, got {num_bytes}")
        if end_ns < start_ns:
            raise InvalidArgumentError("end_ns", f"{end_ns} is before start_ns {start_ns}")
        if num_bytes == 0:
            return
        now_bucket = self._clock() // BUCKET_NS
        first_live = now_bucket - BUCKETS + 1
        ring = self._rings.setdefault((link, transport), _Ring())
        if end_ns == start_ns:
            bucket = end_ns // BUCKET_NS
            if first_live <= bucket <= now_bucket:
                ring.add(bucket, num_bytes)
            return
        rate = num_bytes / (end_ns - start_ns)  # bytes per ns
        lo = max(start_ns // BUCKET_NS, first_live)
        hi = min(end_ns // BUCKET_NS, now_bucket)
        for bucket in range(lo, hi + 1):
            overlap = min(end_ns, (bucket + 1) * BUCKET_NS) - max(start_ns, bucket * BUCKET_NS)
            if overlap > 0:
                ring.add(bucket, rate * overlap)

    def record_handoff(self, link: str, record: HandoffRecord) -> None:
        """One side's finished hand-off: the receiver's read (``recv_*``), else the sender's
        transfer (first layer, or begin, to commit). ``link``: the peer host; an ``shm``
        hand-off is ``SAME_HOST``. One that moved nothing, or was not stamped, is left out."""
        if record.recv_end_ns:
            start, end = record.recv_start_ns, record.recv_end_ns
        else:
            start, end = record.transfer_start_ns, record.send_end_ns
        if record.num_bytes <= 0 or not (start and end) or end < start:
            return
        if record.transport == "shm":
            link = SAME_HOST
        self.record(link or "unknown", record.transport, record.num_bytes, start, end)

    def rates(self) -> tuple[LinkRate, ...]:
        """Every (link, transport) seen: its average and peak bytes/s now (an idle one: 0)."""
        now_bucket = self._clock() // BUCKET_NS
        out = []
        for (link, transport), ring in sorted(self._rings.items()):
            live = ring.live(now_bucket)
            out.append(
                LinkRate(
                    link,
                    transport,
                    average_bps=sum(live) / (WINDOW_NS / 1e9),
                    peak_bps=max(live, default=0.0) / (BUCKET_NS / 1e9),
                )
            )
        return tuple(out)

    def totals(self) -> tuple[float, float]:
        """``(average, peak)`` bytes/s over every link together: the sum of the averages, and
        the busiest 100 ms bucket of all links' bytes added up."""
        now_bucket = self._clock() // BUCKET_NS
        first = now_bucket - BUCKETS + 1
        per_bucket = [0.0] * BUCKETS
        for ring in self._rings.values():
            for b, i in zip(ring.bytes, ring.index, strict=True):
                if first <= i <= now_bucket:
                    per_bucket[i % BUCKETS] += b
        return sum(per_bucket) / (WINDOW_NS / 1e9), max(per_bucket) / (BUCKET_NS / 1e9)
