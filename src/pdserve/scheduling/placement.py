"""Where one request runs: the candidate placements, the serving mode, and admission.

``Placer.place`` works on the scheduler's cached view of the workers:

1. **Candidates per mode.** Colocated: mixed workers that serve ``colocated`` and have room,
   ordered by the placement policy. Disaggregated: decode workers ordered by the policy, and
   for each the prefill workers with the same model fingerprint (not itself), ordered by the
   policy; the pair is the policy's first prefill, unless *affinity* finds a prefill with a
   cheaper transport to that decode worker (same host: shm) whose extra load costs less than
   the transport saves (``kv_aware`` weighs every pair of the first decode workers by
   predicted TTFT instead). **Lanes**: a prompt longer than the long-prompt threshold is
   prefilled only by ``long``-lane workers when there are any; shorter prompts by ``short``
   and ``any`` workers, and by an idle ``long`` one.
2. **Mode.** ``disaggregated`` and ``colocated`` take their own best placement. ``conditional``
   compares the two with the cost model (``costmodel``): a placement whose prefill would stall
   decoding streams past the ITL SLO loses to one that would not; otherwise the lower *cost*
   wins, colocated on a tie. A placement's cost is its predicted TTFT plus the work it adds
   to the cluster beyond computing the prompt (``extra_s``): a disaggregated one pays a
   prefill step's fixed cost, the KV transfer and the extra call; a colocated one rides on a
   decode step that runs anyway (or pays a step's fixed cost on an idle worker). So short
   prompts run colocated next to the decodes, long ones go to a prefill worker once streams
   decode there, a colocated worker with the prompt's prefix cached keeps its turn, and a
   slow link or a long prefill queue tips the balance to colocated. When only one mode has
   room, its placement would stall streams past the ITL SLO, and the other mode has workers
   (only full ones), the request is refused (RESOURCE_EXHAUSTED, the full workers named)
   rather than admitted to break everyone's stream; a configured mode takes what it asked
   for.
3. **Admission.** With a TTFT SLO, a request whose predicted TTFT exceeds it on the best
   placement of every mode the decision could take (placements that would stall streams
   count only when all would) is refused (``Refusal``): it would be late wherever it went,
   and taking it would make the requests behind it late too. A worker that has not timed a
   prefill of its own is never grounds for a refusal.

Everything returned carries its inputs (``ModeDecision``) for spans and metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdserve.scheduling.capacity import (
    CapacityLimits,
    Demand,
    Phase,
    WorkerView,
    ineligibility,
    shortfall,
)
from pdserve.scheduling.costmodel import CostModel, decoding
from pdserve.scheduling.policies import KvAware, PlacementPolicy, RoundRobin

_PAIR_DECODES = 3
"""kv_aware weighs pairs of this many of the best decode workers."""


class Mode(StrEnum):
    """How a request is served."""

    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"
    CONDITIONAL = "conditional"
    """Colocated or disaggregated, decided per request by the cost model."""


class Reason(StrEnum):
    """Why a request got its mode (``ModeDecision.reason``)."""

    CONFIGURED = "configured"
    """The caller asked for that mode."""
    ONLY_COLOCATED = "only_colocated"
    """Conditional, but no disaggregated placement had room."""
    ONLY_DISAGGREGATED = "only_disaggregated"
    """Conditional, but no colocated placement had room."""
    ITL = "itl"
    """The other mode's prefill would stall decoding streams past the ITL SLO."""
    COST = "cost"
    """Both fit the ITL SLO (or neither did); this one has the lower predicted TTFT plus
    added work."""


_FALLBACKS = (Reason.ONLY_COLOCATED, Reason.ONLY_DISAGGREGATED)


@dataclass(frozen=True, slots=True)
class Plan:
    """One placement: its workers (prefill side first) and what the model predicts for it."""

    mode: Mode
    phases: tuple[Phase, ...]
    workers: tuple[WorkerView, ...]
    ttft_s: float
    cached_tokens: int
    """Prompt tokens the prefill-side worker caches (by the KV event index)."""
    stall_s: float
    """What the prefill adds to the decode steps of the prefill-side worker (0: none there)."""
    harms_itl: bool
    extra_s: float = 0.0
    """Work the placement adds to the cluster beyond computing the prompt."""

    @property
    def cost_s(self) -> float:
        return self.ttft_s + self.extra_s


@dataclass(frozen=True, slots=True)
class ModeDecision:
    """The mode a request got, why, and the inputs of that choice."""

    mode: Mode
    reason: Reason
    prompt_tokens: int
    long_prompt: bool
    long_prompt_tokens: int
    colocated_ttft_s: float | None
    disaggregated_ttft_s: float | None
    cached_tokens: int
    stall_s: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """Admission turned the request away: its predicted TTFT misses the SLO everywhere."""

    best_ttft_s: float
    slo_s: float
    details: str


@dataclass(frozen=True, slots=True)
class Placement:
    plan: Plan
    decision: ModeDecision


class Placer:
    """Chooses placements (see the module docstring)."""

    def __init__(
        self,
        policy: PlacementPolicy,
        model: CostModel,
        limits: CapacityLimits,
        *,
        long_prompt_tokens: int = 0,
        ttft_slo_s: float = 0.0,
    ) -> None:
        """``long_prompt_tokens`` 0: from the cost model; ``ttft_slo_s`` 0: no admission."""
        self.policy = policy
        self.base_model = model
        self.model = model
        """``base_model`` calibrated on the views of the current decision."""
        self.limits = limits
        self.long_prompt_tokens = long_prompt_tokens
        self.ttft_slo_s = ttft_slo_s

    def place(
        self,
        views: Sequence[WorkerView],
        demands: Mapping[Phase, Demand],
        mode: Mode,
        *,
        arrivals_per_s: float = 0.0,
    ) -> Placement | Refusal | str:
        """The placement of a request (``demands`` has a Demand per phase), a Refusal, or
        the phase for which no worker had room (``Phase`` value). ``arrivals_per_s``: the
        request rate the scheduler sees."""
        demand = next(iter(demands.values()))
        # Priors from what this cluster measured, for this decision (no await in between).
        self.model = self.base_model.calibrated(views, arrivals_per_s)
        if isinstance(self.policy, KvAware):
            self.policy.model = self.model
        threshold = self.long_prompt_tokens or self.model.long_prompt_tokens(
            [v for v in views if {"prefill", "colocated"} & set(v.info.phases)]
        )
        long = demand.prompt_tokens > threshold
        colocated = disaggregated = None
        failed_pair = Phase.PREFILL.value  # the phase a disaggregated pair found no room for
        if mode in (Mode.COLOCATED, Mode.CONDITIONAL):
            colocated = self._colocated(views, demands[Phase.COLOCATED], long)
        if mode in (Mode.DISAGGREGATED, Mode.CONDITIONAL):
            found = self._disaggregated(views, demands, long)
            if isinstance(found, str):
                failed_pair = found
            else:
                disaggregated = found
        if colocated is None and disaggregated is None:
            return Phase.COLOCATED.value if mode is Mode.COLOCATED else failed_pair
        refusal = self._admission(colocated, disaggregated)
        if refusal is not None:
            return refusal
        plan, reason = self._decide(mode, colocated, disaggregated)
        if mode is Mode.CONDITIONAL and plan.harms_itl and reason in _FALLBACKS:
            # The mode that would not stall anyone exists but is full: wait for it rather than
            # stall every stream on the other (a configured mode takes what it asked for).
            if colocated is None and _serving(views, Phase.COLOCATED):
                return Phase.COLOCATED.value
            if disaggregated is None and _pairable(views):
                return failed_pair
        decision = ModeDecision(
            plan.mode,
            reason,
            demand.prompt_tokens,
            long,
            threshold,
            colocated.ttft_s if colocated is not None else None,
            disaggregated.ttft_s if disaggregated is not None else None,
            plan.cached_tokens,
            plan.stall_s,
        )
        return Placement(plan, decision)

    def place_decode(self, views: Sequence[WorkerView], demand: Demand) -> Placement | str:
        """A decode worker alone, in the policy's order, for a request migrating from a dead
        one (it recomputes the prompt and the tokens generated so far), or ``decode``."""
        ranked = self.ranked(views, demand, None)
        if not ranked:
            return Phase.DECODE.value
        view = ranked[0]
        plan = Plan(Mode.DISAGGREGATED, (Phase.DECODE,), (view,), 0.0, 0, 0.0, False)
        decision = ModeDecision(
            Mode.DISAGGREGATED,
            Reason.CONFIGURED,
            demand.prompt_tokens,
            False,
            0,
            None,
            None,
            0,
            0.0,
        )
        return Placement(plan, decision)

    # -- candidates ----------------------------------------------------------------------------

    def ranked(
        self,
        views: Sequence[WorkerView],
        demand: Demand,
        fingerprint: str | None,
        long: bool = False,
    ) -> list[WorkerView]:
        """Workers fit for ``demand`` (role, model, room, lane), in the policy's order."""
        fitting = [
            v
            for v in views
            if ineligibility(v, demand.phase, fingerprint) is None
            and shortfall(v, demand.claim(v.info.block_size), self.limits) is None
        ]
        if demand.phase is not Phase.DECODE:
            fitting = _in_lane(fitting, long)
        return self.policy.choose(fitting, demand) if fitting else []

    def _colocated(self, views: Sequence[WorkerView], demand: Demand, long: bool) -> Plan | None:
        ranked = self.ranked(views, demand, None, long)
        if not ranked:
            return None
        view = ranked[0]
        uncached = demand.uncached(view.id)
        m = self.model
        return Plan(
            Mode.COLOCATED,
            (Phase.COLOCATED,),
            (view,),
            m.colocated_ttft_s(view, uncached),
            demand.prompt_tokens - uncached,
            m.stall_on(view, uncached),
            m.harms_itl(view, uncached),
            0.0 if decoding(view) else m.overhead_s(view.info),
        )

    def _disaggregated(
        self, views: Sequence[WorkerView], demands: Mapping[Phase, Demand], long: bool
    ) -> Plan | str:
        decodes = self.ranked(views, demands[Phase.DECODE], None)
        if not decodes:
            return Phase.DECODE.value
        pairs: list[Plan] = []
        weighed = 0
        # The prefill side's ranking depends on the decode worker only through its model and
        # by leaving it out: rank once per model and drop the decode worker from that list
        # (a sorted list stays sorted), instead of ranking every candidate per decode worker.
        by_model: dict[str, list[WorkerView]] = {}
        for decode in decodes:
            fingerprint = decode.info.model_fingerprint
            if not isinstance(self.policy, KvAware):
                others = [v for v in views if v.id != decode.id]
                prefills = self.ranked(others, demands[Phase.PREFILL], fingerprint, long)
                if not prefills:
                    continue
                return self._pair(self._affine(prefills, decode, demands), decode, demands)
            if fingerprint not in by_model:
                by_model[fingerprint] = self.ranked(
                    views, demands[Phase.PREFILL], fingerprint, long
                )
            prefills = [p for p in by_model[fingerprint] if p.id != decode.id]
            if not prefills:  # a lane's fallback may differ without this worker: rank anew
                others = [v for v in views if v.id != decode.id]
                prefills = self.ranked(others, demands[Phase.PREFILL], fingerprint, long)
            if not prefills:
                continue
            pairs.extend(self._pair(p, decode, demands) for p in prefills)
            weighed += 1
            if weighed == _PAIR_DECODES:
                break
        if not pairs:
            return Phase.PREFILL.value
        return min(pairs, key=lambda p: (p.harms_itl, p.cost_s))

    def _pair(
        self, prefill: WorkerView, decode: WorkerView, demands: Mapping[Phase, Demand]
    ) -> Plan:
        demand = demands[Phase.PREFILL]
        uncached = demand.uncached(prefill.id)
        moved = demands[Phase.DECODE].uncached(decode.id)
        m = self.model
        return Plan(
            Mode.DISAGGREGATED,
            (Phase.PREFILL, Phase.DECODE),
            (prefill, decode),
            m.disaggregated_ttft_s(prefill, decode, uncached, moved),
            demand.prompt_tokens - uncached,
            m.stall_on(prefill, uncached),
            m.harms_itl(prefill, uncached),
            m.overhead_s(prefill.info) + m.transfer_s(prefill.info, decode.info, moved) + m.hop_s,
        )

    def _affine(
        self, prefills: list[WorkerView], decode: WorkerView, demands: Mapping[Phase, Demand]
    ) -> WorkerView:
        """The policy's first prefill, or one with a cheaper transport to ``decode`` whose
        extra queue costs less than the transport saves (round_robin: always the first)."""
        best = prefills[0]
        if isinstance(self.policy, RoundRobin) or len(prefills) == 1:
            return best
        m, tokens = self.model, demands[Phase.DECODE].prompt_tokens
        best_move = m.transfer_s(best.info, decode.info, tokens)
        for p in prefills[1:]:
            saving = best_move - m.transfer_s(p.info, decode.info, tokens)
            if saving > 0 and m.queue_s(p) - m.queue_s(best) <= saving:
                return p
        return best

    # -- mode and admission --------------------------------------------------------------------

    @staticmethod
    def _decide(
        mode: Mode, colocated: Plan | None, disaggregated: Plan | None
    ) -> tuple[Plan, Reason]:
        if mode is not Mode.CONDITIONAL:
            plan = colocated if mode is Mode.COLOCATED else disaggregated
            assert plan is not None
            return plan, Reason.CONFIGURED
        if disaggregated is None:
            assert colocated is not None
            return colocated, Reason.ONLY_COLOCATED
        if colocated is None:
            return disaggregated, Reason.ONLY_DISAGGREGATED
        if colocated.harms_itl != disaggregated.harms_itl:
            return (disaggregated if colocated.harms_itl else colocated), Reason.ITL
        if colocated.cost_s <= disaggregated.cost_s:
            return colocated, Reason.COST
        return disaggregated, Reason.COST

    def _admission(self, colocated: Plan | None, disaggregated: Plan | None) -> Refusal | None:
        """Refuse when every placement the decision could take (those that stall no stream,
        if there are any) is predicted to miss the TTFT SLO on a worker that timed its own
        prefills."""
        if not self.ttft_slo_s > 0:
            return None
        plans = [p for p in (colocated, disaggregated) if p is not None]
        calm = [p for p in plans if not p.harms_itl] or plans
        best = min(calm, key=lambda p: p.ttft_s)
        worker = best.workers[0]
        if best.ttft_s <= self.ttft_slo_s or not self.model.measured(worker.info):
            return None
        rate = 1 / self.model.token_s(worker.info)
        queued = worker.pending_tokens
        why = f"{queued} prompt tokens queued ahead at {rate:.0f} tokens/s"
        return Refusal(best.ttft_s, self.ttft_slo_s, f"{best.mode.value} on {worker.id}: {why}")


def _serving(views: Sequence[WorkerView], phase: Phase) -> list[WorkerView]:
    """The live workers that serve ``phase``, whatever their load."""
    return [v for v in views if phase.value in v.info.phases and not v.info.draining]


def _pairable(views: Sequence[WorkerView]) -> bool:
    """Two different live workers could prefill and decode, whatever their load."""
    decodes = {v.id for v in _serving(views, Phase.DECODE)}
    return any(decodes - {p.id} for p in _serving(views, Phase.PREFILL))


def _in_lane(views: list[WorkerView], long: bool) -> list[WorkerView]:
    """The workers whose lane takes this prompt's prefill (see the module docstring)."""
    if long:
        dedicated = [v for v in views if v.info.lane == "long"]
        return dedicated or [v for v in views if v.info.lane == "any"] or views
    return [
        v
        for v in views
        if v.info.lane in ("short", "any") or (v.info.lane == "long" and v.pending_tokens == 0)
    ]
