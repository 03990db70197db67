"""A one-line progress bar on stderr, redrawn in place (at most ten times a second)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from pdserve_bench.serve.runner import Counters

WIDTH = 24
MIN_INTERVAL_S = 0.1


class ProgressBar:
    """``update(label, rate, counters)`` on every change; ``done()`` ends the line. Drawing
    is off when ``enabled`` is False or the stream is not a terminal."""

    def __init__(self, stream: TextIO = sys.stderr, *, enabled: bool = True) -> None:
        self._stream = stream
        self._on = enabled and stream.isatty()
        self._last_draw = 0.0
        self._drawn = False
        self._key: tuple[str, float | None] | None = None

    def update(self, label: str, rate: float | None, c: Counters) -> None:
        if not self._on:
            return
        key = (label, rate)
        now = time.monotonic()
        final = c.finished == c.total
        if key == self._key and not final and now - self._last_draw < MIN_INTERVAL_S:
            return
        if key != self._key and self._drawn:
            self._stream.write("\n")  # keep the finished point's last line
        self._key = key
        self._last_draw = now
        self._drawn = True
        self._stream.write("\r" + render(label, rate, c))
        self._stream.flush()

    def done(self) -> None:
        if self._on and self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False
            self._key = None


def render(label: str, rate: float | None, c: Counters) -> str:
    """``label @ 4 req/s [#####.....] 40/100 done, 12 in flight, 3 rejected, 1 failed``."""
    filled = round(WIDTH * c.finished / c.total) if c.total else WIDTH
    bar = "#" * filled + "." * (WIDTH - filled)
    where = f"{label} @ {rate:g} req/s" if rate is not None else label
    return (
        f"{where} [{bar}] {c.finished}/{c.total} done, {c.in_flight} in flight, "
        f"{c.rejected} rejected, {c.errors} failed"
    )
