"""Predicted times of a placement, from what the workers measure and publish.

Every figure comes from a heartbeat (``WorkerInfo``): the worker's live step-time model
(step = overhead + per decoding sequence + per prompt token, ``worker.meter``), its queue
(prompt tokens queued or reserved), its running sequences, and its KV links and transports.
A term a worker has not measured yet takes a prior, so a cold cluster still places requests;
admission never refuses on priors alone (``measured``). ``calibrated`` replaces the priors by
what the workers of the cluster measured (their median): a worker that has not prefilled a
long prompt yet is assumed to be as fast as its peers.

What the model predicts for one request with ``u`` prompt tokens to compute (its prompt minus
what the worker's prefix cache holds, ``prefix_index``):

* **prefill time** on worker ``w``: ``ceil(u / max_batch_tokens)`` steps, each with the step
  overhead, plus ``u`` times the per-token cost;
* **queue wait** on ``w``: the prefill time of the tokens ahead of it;
* **TTFT** colocated on ``m``: queue wait + prefill time on ``m``, each step also carrying
  ``m``'s running decodes;
  disaggregated on ``(p, d)``: queue wait + prefill time on ``p`` + the hand-off to ``d`` (the
  prefill answers once it is done) + the cost of the extra call (``hop_s``): the transport
  ``p`` will take and its time, by the link model and rule ``p`` chooses by (``handoff``);
* **stall**: what one step carrying the prefill, and the prompt tokens queued ahead of it
  there (up to a step's token budget), adds to the inter-token gap of the sequences decoding
  on the same engine; a placement *harms ITL* when a worker that decodes
  would stall its streams past the ITL SLO (what a decode step leaves of it). Where nothing
  decodes yet, the streams at risk are those of the requests expected to arrive while the
  prefill runs (the arrival rate times the stall): at low load a long prompt may run
  colocated, under load it may not. A decode worker whose queued prefill work would stall a
  stream harms the ITL of a stream sent there too. On a host whose engines take turns on the
  cores (the host lease), a step carrying more prompt tokens than the worker's
  ``interactive_tokens`` is bulk work and waits behind the other engines' bulk steps: it
  harms the ITL of the streams it decodes whatever its own length.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import WorkerView
from pdserve.scheduling.worker_info import WorkerInfo
from pdserve.transfer.handle import TransportKind
from pdserve.transfer.links import AUTO, Handoff, Links, choose_transport

EXPECTED_STREAMS = 0.5
"""A prefill on a worker where nothing decodes harms ITL when at least this many requests
are expected to arrive while it runs (their streams would wait behind it)."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """Predictions from heartbeats (see the module docstring); priors for unmeasured terms."""

    itl_slo_s: float = 0.150
    """The inter-token latency every stream should keep (p99 gap between tokens)."""
    prior_prefill_token_s: float = 1 / 4000
    prior_step_overhead_s: float = 0.010
    prior_decode_seq_s: float = 0.0005
    hop_s: float = 0.003
    """What a disaggregated request pays beyond a colocated one besides the KV transfer: a
    second call, the hand-off's bookkeeping."""
    arrivals_per_s: float = 0.0
    """Requests arriving per second, as the scheduler sees them (``calibrated``)."""

    def __post_init__(self) -> None:
        for name in ("itl_slo_s", "prior_prefill_token_s", "prior_step_overhead_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("prior_decode_seq_s", "hop_s"):
            if not getattr(self, name) >= 0:
                raise InvalidArgumentError(name, f"must be >= 0, got {getattr(self, name)}")

    def calibrated(self, views: Sequence[WorkerView], arrivals_per_s: float = 0.0) -> CostModel:
        """This model with its priors set to the median of what ``views`` measured, and the
        current arrival rate."""

        def median(name: str, prior: float) -> float:
            values = [getattr(v.info, name) for v in views if getattr(v.info, name) > 0]
            return statistics.median(values) if values else prior

        return dataclasses.replace(
            self,
            prior_prefill_token_s=median("prefill_token_s", self.prior_prefill_token_s),
            prior_step_overhead_s=median("step_overhead_s", self.prior_step_overhead_s),
            prior_decode_seq_s=median("decode_seq_s", self.prior_decode_seq_s),
            arrivals_per_s=arrivals_per_s,
        )

    # -- per worker ----------------------------------------------------------------------------

    @staticmethod
    def measured(info: WorkerInfo) -> bool:
        """The worker has timed prefills of its own (its predictions rest on no prior)."""
        return info.prefill_token_s > 0

    def token_s(self, info: WorkerInfo) -> float:
        return info.prefill_token_s or self.prior_prefill_token_s

    def overhead_s(self, info: WorkerInfo) -> float:
        return info.step_overhead_s or self.prior_step_overhead_s

    def decode_step_s(self, info: WorkerInfo, seqs: int) -> float:
        """One decode step of ``seqs`` sequences."""
        per_seq = info.decode_seq_s or self.prior_decode_seq_s
        return self.overhead_s(info) + per_seq * seqs

    def prefill_s(self, info: WorkerInfo, tokens: int, *, decodes: int = 0) -> float:
        """Computing ``tokens`` prompt tokens, in steps that also carry ``decodes`` sequences."""
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / max(1, info.max_batch_tokens))
        per_seq = info.decode_seq_s or self.prior_decode_seq_s
        return steps * (self.overhead_s(info) + per_seq * decodes) + tokens * self.token_s(info)

    def queue_s(self, view: WorkerView) -> float:
        """Waiting for the prompt tokens queued or reserved ahead on the worker."""
        return self.prefill_s(view.info, view.pending_tokens)

    def stall_s(self, info: WorkerInfo, tokens: int) -> float:
        """What one step carrying (a chunk of) a ``tokens``-token prefill adds to a decode step."""
        return min(tokens, max(1, info.max_batch_tokens)) * self.token_s(info)

    def stall_on(self, view: WorkerView, tokens: int) -> float:
        """What prefilling ``tokens`` here adds to the step of the worker's decoding streams
        (0 when none decode there). The step that carries them also carries the prompt tokens
        queued ahead (the engine fills a step's token budget from its waiting queue), so many
        medium prompts arriving together stall the streams as one long one would."""
        return self.stall_s(view.info, _with_queued(view, tokens)) if decoding(view) else 0.0

    def itl_budget_s(self, view: WorkerView) -> float:
        """What a decode step of the worker leaves of the ITL SLO for prefill work."""
        return self.itl_slo_s - self.decode_step_s(view.info, decoding(view) + 1)

    def harms_itl(self, view: WorkerView, tokens: int) -> bool:
        """Prefilling ``tokens`` here would push the worker's decoding streams past the ITL SLO."""
        if not {"decode", "colocated"} & set(view.info.phases):
            return False
        info, queued = view.info, _with_queued(view, tokens)
        if decoding(view) and 0 < info.interactive_tokens < min(queued, info.max_batch_tokens):
            # The step turns bulk on a shared host: it waits for the cores behind the other
            # engines' bulk steps (whole prefill steps), and its streams with it.
            return True
        stall = self.stall_s(info, queued)
        if stall <= self.itl_budget_s(view):
            return False
        if decoding(view) > 0:
            return True
        # Nothing decodes there now: the streams at risk are those that would start meanwhile.
        return self.arrivals_per_s * stall >= EXPECTED_STREAMS

    # -- between workers -----------------------------------------------------------------------

    @staticmethod
    def handoff(prefill: WorkerInfo, decode: WorkerInfo, tokens: int) -> Handoff:
        """The transport ``prefill`` will take to hand ``tokens`` tokens of KV to ``decode``,
        and its time: ``transfer.links.choose_transport`` on what ``prefill`` publishes."""
        per_token = prefill.kv_bytes_per_token or decode.kv_bytes_per_token
        return choose_transport(
            Links(prefill.host, prefill.links),
            decode.host,
            max(0, tokens),
            max(0, tokens) * per_token,
            prefill_token_s=prefill.prefill_token_s,
            step_overhead_s=prefill.step_overhead_s,
            allowed=tuple(TransportKind(t) for t in prefill.transports) or AUTO,
        )

    def transfer_s(self, prefill: WorkerInfo, decode: WorkerInfo, tokens: int) -> float:
        """Handing ``tokens`` tokens of KV from ``prefill`` to ``decode`` over (``handoff``)."""
        return self.handoff(prefill, decode, tokens).seconds

    # -- whole placements ----------------------------------------------------------------------

    def colocated_ttft_s(self, view: WorkerView, uncached: int) -> float:
        return self.queue_s(view) + self.prefill_s(view.info, uncached, decodes=decoding(view))

    def disaggregated_ttft_s(
        self, prefill: WorkerView, decode: WorkerView, uncached: int, moved: int
    ) -> float:
        """``uncached`` tokens computed on ``prefill``, ``moved`` tokens' KV sent to ``decode``."""
        compute = self.prefill_s(prefill.info, uncached, decodes=decoding(prefill))
        move = self.transfer_s(prefill.info, decode.info, moved)
        return self.queue_s(prefill) + compute + move + self.hop_s

    def long_prompt_tokens(self, views: list[WorkerView]) -> int:
        """The prompt length past which a prefill step stalls decoding streams by more than
        half the ITL SLO on a typical worker (the median per-token cost of ``views``)."""
        costs = sorted(self.token_s(v.info) for v in views) or [self.prior_prefill_token_s]
        return max(1, int(self.itl_slo_s / 2 / costs[len(costs) // 2]))


def _with_queued(view: WorkerView, tokens: int) -> int:
    """``tokens`` plus the prompt tokens queued ahead on the worker: what the engine's next
    prefill steps carry (it fills a step's budget from its waiting queue)."""
    return view.pending_tokens + tokens


def decoding(view: WorkerView) -> int:
    """Sequences decoding on the worker, or about to (reserved, not admitted): 0 for a worker
    that serves no decode."""
    if not {"decode", "colocated"} & set(view.info.phases):
        return 0
    incoming = 1 if view.reserved.blocks > 0 else 0
    return view.info.running_seqs + incoming


class ArrivalRate:
    """Requests per second: the inverse of an exponentially weighted mean gap between
    arrivals; an idle stretch longer than that mean counts as the gap so far."""

    def __init__(self, *, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self._last: float | None = None
        self._gap: float | None = None

    def arrived(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is not None:
            gap = now - self._last
            self._gap = gap if self._gap is None else self._gap + self.alpha * (gap - self._gap)
        self._last = now

    def rate(self, now: float | None = None) -> float:
        if self._gap is None or self._last is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return 1.0 / max(self._gap, now - self._last, 1e-6)
