"""``Fitted``: a step-time model fit to an engine's measured steps (``pdserve sim calibrate``).

Linear in five features of a ``SimStep`` (``features``); ``fit`` finds non-negative
coefficients from (step, seconds) samples; ``Fitted.save``/``load`` keep it as JSON, with the
model shape it was measured on and, for a CPU engine, the same fit on shares of its threads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.errors import InvalidArgumentError
from pdserve.sim.shapes import ModelShape
from pdserve.sim.timing import PROFILE_FLAG, SimStep

_COEFFICIENTS = (
    "overhead_s",
    "prefill_token_s",
    "decode_seq_s",
    "attention_pair_s",
    "kv_read_token_s",
)
FITTED_FORMAT = "pdserve-sim-fitted"
FITTED_VERSION = 1
SPREAD_POINTS = 100
"""Quantiles of a fit's residuals (measured less predicted seconds) kept in a profile."""
FASTEST = 0.5
"""A step drawn from the spread takes at least this share of its predicted time."""


def features(step: SimStep) -> tuple[float, float, float, float, float]:
    """The ``Fitted`` model's features, in ``_COEFFICIENTS`` order: a constant, prefill
    tokens, decoding sequences, attention pairs, and KV tokens read from the cache."""
    return (
        1.0,
        float(step.prefill_tokens),
        float(step.num_decodes),
        float(step.attention_pairs),
        float(step.decode_context + step.prefix_tokens),
    )


@dataclass(frozen=True, slots=True)
class Fitted:
    """A step time linear in ``features``, fit to measured steps (``fit``).

    The features mirror the roofline's terms: per-token matmul work (prefill tokens), per
    sequence work that batch size does not amortise (decodes: sampling, LM head, KV writes),
    attention FLOPs (pairs) and KV reads. Unlike the roofline the regimes add up rather than
    overlap, which fits one device's measured curve well within the range it was fit on.

    A CPU engine that shares its host splits its threads while a long prefill runs beside
    decode steps (``compute.lease``): each side then steps on a share of the threads, and
    more slowly than on all of them (not in proportion: a decode step is not all
    parallel). ``shares`` holds the same engine measured on those shares, so a sim engine
    that models a split host prices each step on the threads it runs on (``on_threads``).
    """

    overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    attention_pair_s: float
    kv_read_token_s: float
    model: ModelShape
    device: str
    samples: int
    rel_error: float
    threads: int = 0
    """Engine threads the steps ran on; 0: not recorded (a profile of an accelerator)."""
    shares: tuple[Fitted, ...] = ()
    """The same engine measured on fewer threads, each with its ``threads``, none with
    shares of its own."""
    spread: tuple[float, ...] = ()
    """How the measured steps varied about the fit: measured less predicted seconds at
    ``SPREAD_POINTS`` evenly spaced quantiles, ascending. A sim engine adds one drawn from
    them to each step (``varied``), so its steps vary, tails included, as the measured ones
    did. Added, not multiplied: what stretches a step on a shared host is a wait for a
    core, whatever the step's length. Empty: every step takes the predicted time."""

    def __post_init__(self) -> None:
        for share in self.shares:
            if share.shares or not 0 < share.threads < self.threads:
                raise InvalidArgumentError(
                    "shares", f"a share needs 1..{self.threads - 1} threads and no shares"
                )
        if not all(np.isfinite(r) for r in self.spread):
            raise InvalidArgumentError("spread", "the residuals must be finite")

    def varied(self, seconds: float, u: float) -> float:
        """A step predicted at ``seconds``, with the residual at quantile ``u`` (uniform in
        [0, 1)) of ``spread`` added; never below ``FASTEST`` of ``seconds``."""
        if not self.spread or seconds <= 0:
            return seconds
        residual = self.spread[min(len(self.spread) - 1, int(u * len(self.spread)))]
        return max(FASTEST * seconds, seconds + residual)

    def on_threads(self, threads: int) -> Fitted | None:
        """The fit measured on ``threads`` threads; None where none was."""
        if threads == self.threads:
            return self
        return next((s for s in self.shares if s.threads == threads), None)

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (
            self.overhead_s,
            self.prefill_token_s,
            self.decode_seq_s,
            self.attention_pair_s,
            self.kv_read_token_s,
        )

    def step_time(self, step: SimStep) -> float:
        if step.is_empty:
            return 0.0
        return sum(c * x for c, x in zip(self.coefficients, features(step), strict=True))

    def describe(self) -> str:
        return (
            f"fitted {self.model.name} on {self.device} ({self.samples} samples, "
            f"median error {self.rel_error:.1%})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FITTED_FORMAT,
            "version": FITTED_VERSION,
            "model": self.model.to_json(),
            **self._fit_json(),
            "shares": [share._fit_json() for share in self.shares],
        }

    def _fit_json(self) -> dict[str, Any]:
        """What one measurement holds (the whole profile's but its model and shares)."""
        return {
            "device": self.device,
            "threads": self.threads,
            "samples": self.samples,
            "rel_error": self.rel_error,
            "coefficients": dict(zip(_COEFFICIENTS, self.coefficients, strict=True)),
            "spread": list(self.spread),
        }

    def save(self, path: Path | str) -> None:
        """Write the JSON file atomically (a reader never sees half of it)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path | str, flag: str = PROFILE_FLAG) -> Fitted:
        """Read a file ``save`` wrote; anything else is refused naming ``flag`` and the file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise InvalidArgumentError(flag, f"cannot read fitted profile {path}: {e}") from e

        def bad(what: str) -> InvalidArgumentError:
            return InvalidArgumentError(flag, f"{path}: {what}")

        if not isinstance(data, dict) or data.get("format") != FITTED_FORMAT:
            raise bad(f"not a fitted profile (format is not {FITTED_FORMAT!r})")
        if data.get("version") != FITTED_VERSION:
            raise bad(f"version {data.get('version')!r} is not {FITTED_VERSION}")
        if "model" not in data:
            raise bad("missing 'model'")
        shape = ModelShape.from_json(data["model"], flag=flag, source=str(path))
        shares = data.get("shares", [])
        if not isinstance(shares, list) or not all(isinstance(s, dict) for s in shares):
            raise bad("'shares' is not a list of objects")
        parts = tuple(_fit_from_json(s, shape, bad) for s in shares)
        whole = _fit_from_json(data, shape, bad)
        try:
            return dataclasses.replace(whole, shares=parts)
        except InvalidArgumentError as e:
            raise bad(str(e)) from None


def _fit_from_json(
    data: dict[str, Any], shape: ModelShape, bad: Callable[[str], InvalidArgumentError]
) -> Fitted:
    """One measurement of a profile file (``Fitted._fit_json``'s keys; ``threads`` optional)."""
    for key in ("device", "samples", "rel_error", "coefficients"):
        if key not in data:
            raise bad(f"missing '{key}'")
    coeffs = data["coefficients"]
    if not isinstance(coeffs, dict):
        raise bad("'coefficients' is not an object")
    values: dict[str, float] = {}
    for key in _COEFFICIENTS:
        if key not in coeffs:
            raise bad(f"missing coefficient '{key}'")
        values[key] = _non_negative(coeffs[key], key, bad)
    device, samples, threads = data["device"], data["samples"], data.get("threads", 0)
    if not isinstance(device, str):
        raise bad("'device' is not a string")
    for key, value in (("samples", samples), ("threads", threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(f"'{key}' {value!r} is not a non-negative int")
    rel_error = _non_negative(data["rel_error"], "rel_error", bad)
    spread = data.get("spread", [])
    if not isinstance(spread, list):
        raise bad("'spread' is not a list")
    if not all(isinstance(r, int | float) and not isinstance(r, bool) for r in spread):
        raise bad("'spread' holds a value that is not a number")
    residuals = tuple(float(r) for r in spread)
    if not all(np.isfinite(r) for r in residuals) or list(residuals) != sorted(residuals):
        raise bad("'spread' is not an ascending list of finite residuals (seconds)")
    return _fitted(
        [values[key] for key in _COEFFICIENTS],
        model=shape,
        device=device,
        samples=samples,
        rel_error=rel_error,
        threads=threads,
        spread=residuals,
    )


def _fitted(coefficients: Sequence[float], **fields: Any) -> Fitted:
    """A ``Fitted`` of ``coefficients`` in ``_COEFFICIENTS`` order and the other ``fields``."""
    overhead, prefill, decode, pairs, kv_read = coefficients
    return Fitted(overhead, prefill, decode, pairs, kv_read, **fields)


def _non_negative(value: Any, key: str, bad: Callable[[str], InvalidArgumentError]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise bad(f"'{key}' {value!r} is not a non-negative number")
    if not np.isfinite(value):
        raise bad(f"'{key}' {value!r} is not finite")
    return float(value)


def fit(
    samples: Sequence[tuple[SimStep, float]], model: ModelShape, device: str, threads: int = 0
) -> Fitted:
    """Fit ``Fitted``'s coefficients to measured (step, seconds) samples.

    Least squares on the rows weighted by 1/seconds, so the fit minimises relative error and
    a 5 ms decode step counts as much as a 500 ms prefill. Non-negativity by elimination:
    while some coefficient is negative, the most negative one is fixed at 0 and the rest are
    refit. The samples must vary enough to tell the five features apart (at least 5 steps,
    with prefills with and without cached prefixes, and decode batches of several sizes).
    """
    if len(samples) < 5:
        raise InvalidArgumentError("samples", f"need at least 5 measured steps, got {len(samples)}")
    X = np.array([features(step) for step, _ in samples], dtype=np.float64)
    y = np.array([seconds for _, seconds in samples], dtype=np.float64)
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise InvalidArgumentError("samples", "every measured step time must be > 0 and finite")
    if any(step.is_empty for step, _ in samples):
        raise InvalidArgumentError("samples", "an empty step cannot be a sample")
    # Scale each column to max 1 so the rank test and lstsq see comparable magnitudes
    # (attention pairs run to 1e7 where the constant is 1); an all-zero column stays zero.
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    W = Xs / y[:, None]
    if np.linalg.matrix_rank(W) < len(_COEFFICIENTS):
        raise InvalidArgumentError(
            "samples",
            "the steps do not vary enough to fit all of "
            f"{', '.join(_COEFFICIENTS)}: mix decode batch sizes and contexts with prefills "
            "of several lengths, some after a cached prefix",
        )
    ones = np.ones_like(y)
    active = list(range(len(_COEFFICIENTS)))
    beta = np.zeros(len(_COEFFICIENTS))
    while active:
        sol, *_ = np.linalg.lstsq(W[:, active], ones, rcond=None)
        beta[:] = 0.0
        beta[active] = sol
        if sol.min() >= 0:
            break
        active.pop(int(np.argmin(sol)))
    coeffs = beta / scale
    predicted = X @ coeffs
    rel = np.abs(predicted - y) / y
    points = (np.arange(SPREAD_POINTS) + 0.5) / SPREAD_POINTS
    spread = np.quantile(y - predicted, points)
    return _fitted(
        [float(c) for c in coeffs],
        model=model,
        device=device,
        samples=len(samples),
        rel_error=float(np.median(rel)),
        threads=threads,
        spread=tuple(round(float(r), 6) for r in spread),
    )
