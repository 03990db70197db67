"""How long one engine step takes on a modelled accelerator, without computing it.

A step is reduced to ``SimStep``: the prompt chunks it computes and the sequences it decodes,
with the context each one attends to. Two ``TimingModel``s price it:

* ``Roofline``: from first principles. FLOPs (matmuls, attention, the LM head) against the
  accelerator's peak, bytes (weights once, KV read and written) against its bandwidth; the
  step takes the larger of the two, plus a fixed overhead and, under tensor parallelism, the
  all-reduces.
* ``Fitted``: a linear model in five step features whose non-negative coefficients are fit
  (``fit``) to step times measured on real hardware, saved as JSON.

``parse_profile`` turns a ``--sim-profile`` string into either, with the model it prices.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pdserve.errors import InvalidArgumentError
from pdserve.sim.shapes import Accelerator, ModelShape, accelerator, model

if TYPE_CHECKING:
    from pdserve.engine.scheduler import SchedulerOutput

_DEFAULT_FLAG = "--sim-profile"
# Latency of one tensor-parallel all-reduce, on top of its bytes over the interconnect (NCCL
# ring all-reduces of small messages over NVLink take single-digit microseconds).
ALL_REDUCE_LATENCY_S = 5e-6


@dataclass(frozen=True, slots=True)
class SimStep:
    """What one engine step computes, as far as its cost goes.

    ``prefills``: per prompt chunk, (tokens computed this step, tokens already in the KV
    cache before the chunk). ``decodes``: per decoding sequence, the keys its new token
    attends to, the new one included (its context length).
    """

    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for n, c in self.prefills:
            if n < 1 or c < 0:
                raise ValueError(f"prefill chunk ({n}, {c}): need tokens >= 1, context >= 0")
        for d in self.decodes:
            if d < 1:
                raise ValueError(f"decode context {d}: need >= 1 (the new token itself)")

    @property
    def prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefills)

    @property
    def num_decodes(self) -> int:
        return len(self.decodes)

    @property
    def num_tokens(self) -> int:
        """Rows through the model: every prefill token and one per decode."""
        return self.prefill_tokens + self.num_decodes

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs attention scores: token i (1-based) of a chunk of n after c
        cached tokens sees c + i keys, n*c + n(n+1)/2 per chunk; a decode sees its context."""
        return sum(n * c + n * (n + 1) // 2 for n, c in self.prefills) + sum(self.decodes)

    @property
    def prefix_tokens(self) -> int:
        """Cached tokens the prefill chunks read back from the KV cache."""
        return sum(c for _, c in self.prefills)

    @property
    def decode_context(self) -> int:
        """Keys the decodes read from the KV cache, summed."""
        return sum(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


def step_of(out: SchedulerOutput) -> SimStep:
    """The ``SimStep`` of a scheduler output, read before ``Scheduler.update`` advances
    ``num_computed_tokens``. Duck-typed: anything with ``prefills`` and ``decodes`` of
    ``(seq.num_computed_tokens, num_tokens)`` chunks will do."""
    return SimStep(
        prefills=tuple((c.num_tokens, c.seq.num_computed_tokens) for c in out.prefills),
        decodes=tuple(c.seq.num_computed_tokens + 1 for c in out.decodes),
    )


class TimingModel(Protocol):
    def step_time(self, step: SimStep) -> float:
        """Seconds the step takes on the modelled hardware; >= 0, and 0 for an empty step."""
        ...

    def describe(self) -> str:
        """One line for logs and status: what is modelled."""
        ...


@dataclass(frozen=True, slots=True)
class Roofline:
    """First-principles step time: ``overhead + max(compute, memory) + tp_comm``.

    Compute and memory traffic are assumed to overlap perfectly (hence the max). Tensor
    parallelism over ``tp`` devices is modelled as compute and memory traffic split perfectly
    ``tp`` ways, plus two ring all-reduces of the activations per layer (after attention and
    after the MLP) over the interconnect; the fixed overhead is not split.
    """

    accelerator: Accelerator
    model: ModelShape
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise InvalidArgumentError("tp", f"tensor parallelism must be >= 1, not {self.tp}")

    def flops(self, step: SimStep) -> float:
        """Matmuls (2 FLOPs per parameter per row), the LM head on rows that sample (every
        prefill chunk counts as sampling), and attention: QK^T and PV, 2 FLOPs each per
        (query, key) pair per head dimension per head per layer."""
        m = self.model
        rows = step.num_tokens
        sampled = len(step.prefills) + step.num_decodes
        attn = 4 * m.num_layers * m.num_heads * m.head_dim * step.attention_pairs
        return float(2 * m.dense_params * rows + 2 * m.lm_head_params * sampled + attn)

    def bytes_moved(self, step: SimStep) -> float:
        """Every weight read once, the cached KV read (decode contexts and prefill prefixes),
        and the new rows' KV written."""
        m = self.model
        kv_read = m.kv_bytes_per_token * (step.decode_context + step.prefix_tokens)
        kv_written = m.kv_bytes_per_token * step.num_tokens
        return float(m.weight_bytes + kv_read + kv_written)

    def compute_s(self, step: SimStep) -> float:
        a = self.accelerator
        return self.flops(step) / (self.tp * a.peak_flops * a.compute_efficiency)

    def memory_s(self, step: SimStep) -> float:
        a = self.accelerator
        return self.bytes_moved(step) / (self.tp * a.mem_bandwidth * a.memory_efficiency)

    def tp_comm_s(self, step: SimStep) -> float:
        """Two ring all-reduces per layer of the [rows, hidden] activations, each moving
        2*(tp-1)/tp of its bytes over the interconnect, plus a fixed latency each."""
        if self.tp == 1:
            return 0.0
        m = self.model
        size = step.num_tokens * m.hidden_size * m.dtype_bytes
        ring = 2 * (self.tp - 1) / self.tp * size / self.accelerator.interconnect_bandwidth
        return 2 * m.num_layers * (ring + ALL_REDUCE_LATENCY_S)

    def step_time(self, step: SimStep) -> float:
        if step.is_empty:
            return 0.0
        busy = max(self.compute_s(step), self.memory_s(step))
        return self.accelerator.step_overhead_s + busy + self.tp_comm_s(step)

    def describe(self) -> str:
        return f"roofline {self.accelerator.name} {self.model.name} tp{self.tp}"

    def kv_capacity_tokens(self, mem_fraction: float = 0.9, *, flag: str = _DEFAULT_FLAG) -> int:
        """Tokens of KV that fit in ``mem_fraction`` of the ``tp`` devices' memory once the
        weights are loaded. Refused when the weights leave no room (suggesting a TP that
        would)."""
        if not 0.0 < mem_fraction <= 1.0:
            raise InvalidArgumentError(flag, f"mem_fraction must be in (0, 1], not {mem_fraction}")
        m = self.model
        per_device = self.accelerator.mem_bytes * mem_fraction
        free = per_device * self.tp - m.weight_bytes
        tokens = int(free // m.kv_bytes_per_token) if free > 0 else 0
        if tokens < 1:
            need = self.tp
            while per_device * need - m.weight_bytes < m.kv_bytes_per_token:
                need *= 2
            raise InvalidArgumentError(
                flag,
                f"{m.name} weights ({m.weight_bytes / 2**30:.1f} GiB) leave no room for KV in "
                f"{mem_fraction:.0%} of {self.tp} x {self.accelerator.name} "
                f"({per_device * self.tp / 2**30:.1f} GiB); try tp{need} or more",
            )
        return tokens


_COEFFICIENTS = (
    "overhead_s",
    "prefill_token_s",
    "decode_seq_s",
    "attention_pair_s",
    "kv_read_token_s",
)
FITTED_FORMAT = "pdserve-sim-fitted"
FITTED_VERSION = 1


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
            "device": self.device,
            "samples": self.samples,
            "rel_error": self.rel_error,
            "coefficients": dict(zip(_COEFFICIENTS, self.coefficients, strict=True)),
        }

    def save(self, path: Path | str) -> None:
        """Write the JSON file atomically (a reader never sees half of it)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path | str, flag: str = _DEFAULT_FLAG) -> Fitted:
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
        for key in ("model", "device", "samples", "rel_error", "coefficients"):
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
        device, samples = data["device"], data["samples"]
        if not isinstance(device, str):
            raise bad("'device' is not a string")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise bad(f"'samples' {samples!r} is not a non-negative int")
        shape = ModelShape.from_json(data["model"], flag=flag, source=str(path))
        rel_error = _non_negative(data["rel_error"], "rel_error", bad)
        return cls(**values, model=shape, device=device, samples=samples, rel_error=rel_error)


def _non_negative(value: Any, key: str, bad: Callable[[str], InvalidArgumentError]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise bad(f"'{key}' {value!r} is not a non-negative number")
    if not np.isfinite(value):
        raise bad(f"'{key}' {value!r} is not finite")
    return float(value)


def fit(samples: Sequence[tuple[SimStep, float]], model: ModelShape, device: str) -> Fitted:
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
    rel = np.abs(X @ coeffs - y) / y
    values = dict(zip(_COEFFICIENTS, (float(c) for c in coeffs), strict=True))
    return Fitted(
        **values, model=model, device=device, samples=len(samples), rel_error=float(np.median(rel))
    )


@dataclass(frozen=True, slots=True)
class SimProfile:
    """A parsed ``--sim-profile``: the timing model, the model it prices, and the KV tokens
    the modelled devices hold (None where unknown: a fitted profile; the engine's own KV
    sizing applies)."""

    spec: str
    timing: TimingModel
    model: ModelShape
    kv_tokens: int | None


PROFILE_FORMS = (
    "roofline:<accelerator>:<model>",
    "roofline:<accelerator>:<model>:tp<N>",
    "fitted:<file.json>",
)
_TP = re.compile(r"tp(\d+)")


def parse_profile(spec: str, flag: str = _DEFAULT_FLAG) -> SimProfile:
    """Parse ``roofline:<accelerator>:<model>[:tp<N>]`` (model: a built-in name or a
    config.json path, which may itself hold ':') or ``fitted:<file.json>``."""
    forms = "; accepted: " + ", ".join(PROFILE_FORMS)
    kind, sep, rest = spec.partition(":")
    if kind == "fitted" and rest:
        fitted = Fitted.load(rest, flag=flag)
        return SimProfile(spec, fitted, fitted.model, None)
    if kind == "roofline" and rest:
        acc_name, sep, model_part = rest.partition(":")
        tp = 1
        head, colon, last = model_part.rpartition(":")
        match = _TP.fullmatch(last)
        if colon and match:
            model_part, tp = head, int(match.group(1))
        if not acc_name or not sep or not model_part:
            raise InvalidArgumentError(flag, f"{spec!r} names no accelerator or model{forms}")
        if tp < 1:
            raise InvalidArgumentError(flag, f"{spec!r}: tp must be >= 1{forms}")
        roofline = Roofline(accelerator(acc_name, flag), model(model_part, flag), tp)
        return SimProfile(spec, roofline, roofline.model, roofline.kv_capacity_tokens(flag=flag))
    raise InvalidArgumentError(flag, f"unknown simulation profile {spec!r}{forms}")
