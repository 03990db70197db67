"""StepMeter: a live model of how long this engine's steps take, fed by every step it runs.

The scheduler predicts time to first token and inter-token latency from what each worker
publishes in its heartbeat; nothing is profiled beforehand. The model is linear::

    step seconds ~= overhead + decode_seq * decoding sequences + prefill_token * prompt tokens

fitted online in two parts, each an exponentially weighted least-squares fit (recent steps
count most, so the model follows the host's load):

* steps that only decode give ``overhead`` and ``decode_seq`` (time against batch size);
* steps that compute at least ``min_prefill_tokens`` prompt tokens give ``prefill_token``:
  what the step took beyond the decode part the first fit predicts, per prompt token. Short
  prefills are left out: a step of a few dozen prompt tokens costs little more than a decode
  step (it reads the same weights), so their per-token figure would make a long prompt look
  several times cheaper than it is, and long prompts are what the figure must predict.

A step's time is its wall time on the engine thread, waits for a shared host's cores
included: what the next request will see, not what the hardware could do alone. ``busy`` is
the share of recent wall time spent in steps.

Written by the engine thread only; ``reading()`` returns an immutable snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class StepModel:
    """The fitted model; a 0 means nothing measured yet for that term."""

    overhead_s: float = 0.0
    decode_seq_s: float = 0.0
    prefill_token_s: float = 0.0
    busy: float = 0.0
    """Share of recent wall time spent in steps, 0..1, as of ``as_of``."""
    as_of: float = 0.0
    """``perf_counter()`` at the end of the latest step."""
    busy_window_s: float = 5.0

    def busy_at(self, now: float) -> float:
        """``busy`` decayed over the idle time since ``as_of``."""
        if now <= self.as_of:
            return self.busy
        return self.busy * math.exp(-(now - self.as_of) / self.busy_window_s)


class StepMeter:
    """Fits ``StepModel`` from ``observe`` calls (see the module docstring).

    A step weighs half once 64 newer steps of its kind came. ``busy_window_s`` is the time
    constant of ``busy``.
    """

    def __init__(self, *, busy_window_s: float = 5.0, min_prefill_tokens: int = 256) -> None:
        self.min_prefill_tokens = min_prefill_tokens
        if not busy_window_s > 0:
            raise InvalidArgumentError("busy_window_s", f"must be > 0, got {busy_window_s}")
        self._keep = 0.5 ** (1.0 / 64)
        self._busy_window_s = busy_window_s
        # Decode-only steps: weighted sums for t = a + b * n.
        self._w = self._sn = self._st = self._snn = self._snt = 0.0
        # Prefill steps: weighted sums of (prompt tokens, seconds beyond the decode part).
        self._pw = self._ptok = self._pextra = 0.0
        self._busy = 0.0
        self._last_end: float | None = None

    def observe(self, prefill_tokens: int, decodes: int, started: float, ended: float) -> None:
        """One step from ``started`` to ``ended`` (``time.perf_counter()``) that computed
        ``prefill_tokens`` prompt tokens and decoded ``decodes`` sequences."""
        seconds = ended - started
        if not seconds > 0 or (prefill_tokens <= 0 and decodes <= 0):
            return
        k = self._keep
        if prefill_tokens <= 0:
            n = float(decodes)
            self._w = k * self._w + 1.0
            self._sn = k * self._sn + n
            self._st = k * self._st + seconds
            self._snn = k * self._snn + n * n
            self._snt = k * self._snt + n * seconds
        elif prefill_tokens >= self.min_prefill_tokens:
            a, b = self._decode_fit()
            extra = max(seconds - a - b * decodes, seconds * 0.1)
            self._pw = k * self._pw + 1.0
            self._ptok = k * self._ptok + prefill_tokens
            self._pextra = k * self._pextra + extra
        self._observe_busy(started, ended)

    def _observe_busy(self, started: float, ended: float) -> None:
        if self._last_end is None:
            self._last_end = started
        span = max(ended - self._last_end, ended - started)
        share = (ended - started) / span if span > 0 else 1.0
        weight = 1.0 - math.exp(-span / self._busy_window_s)
        self._busy += weight * (share - self._busy)
        self._last_end = ended

    def _decode_fit(self) -> tuple[float, float]:
        """(overhead, per-sequence) of decode-only steps; a ratio while batch sizes never varied."""
        if self._w <= 0:
            return 0.0, 0.0
        mean_n, mean_t = self._sn / self._w, self._st / self._w
        var = self._snn / self._w - mean_n * mean_n
        if var <= 1e-9 * max(1.0, mean_n * mean_n):
            return mean_t, 0.0  # one batch size only: all of it looks like overhead
        slope = (self._snt / self._w - mean_n * mean_t) / var
        slope = max(0.0, slope)
        return max(0.0, mean_t - slope * mean_n), slope

    def reading(self) -> StepModel:
        """The model as of the latest step."""
        a, b = self._decode_fit()
        per_token = self._pextra / self._ptok if self._ptok > 0 else 0.0
        busy = min(1.0, max(0.0, self._busy))
        return StepModel(a, b, per_token, busy, self._last_end or 0.0, self._busy_window_s)
