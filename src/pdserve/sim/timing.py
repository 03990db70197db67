"""How long one engine step takes on a modelled accelerator, without computing it.

A step is reduced to ``SimStep``: the prompt chunks it computes and the sequences it decodes,
with the context each one attends to. Two ``TimingModel``s price it:

* ``Roofline``: from first principles. FLOPs (matmuls, attention, the LM head) against the
  accelerator's peak, bytes (weights once, KV read and written) against its bandwidth; the
  step takes the larger of the two, plus a fixed overhead and, under tensor parallelism, the
  all-reduces.
* ``Fitted`` (``sim.fitted``): a linear model in five step features whose non-negative
  coefficients are fit to step times measured on real hardware, saved as JSON.

``sim.profile.parse_profile`` turns a ``--sim-profile`` string into either, with the model
it prices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.errors import InvalidArgumentError
from pdserve.sim.shapes import Accelerator, ModelShape

if TYPE_CHECKING:
    from pdserve.engine.scheduler import SchedulerOutput

PROFILE_FLAG = "--sim-profile"
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

    def kv_capacity_tokens(self, mem_fraction: float = 0.9, *, flag: str = PROFILE_FLAG) -> int:
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
