"""Placement on fake worker views: conditional mode, kv_aware, affinity, lanes, admission."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from pdserve.scheduling.capacity import CapacityLimits, Demand, Phase, WorkerView
from pdserve.scheduling.costmodel import CostModel
from pdserve.scheduling.placement import Placement, Placer, Reason, Refusal
from pdserve.scheduling.policies import make_policy
from pdserve.scheduling.scheduler import Mode
from pdserve.scheduling.worker_info import WorkerRole

from .factories import view

MODEL = CostModel(itl_slo_s=0.150)
# A measured worker: 0.3 ms per prompt token, 10 ms per step, 1 ms per decoding sequence.
MEASURED: dict[str, Any] = {
    "step_overhead_s": 0.010,
    "decode_seq_s": 0.001,
    "prefill_token_s": 0.0003,
    "max_batch_tokens": 2048,
    "kv_blocks_total": 1000,
    "kv_blocks_free": 1000,
    "kv_bytes_per_token": 8192,
}
PHASES = {
    Mode.COLOCATED: (Phase.COLOCATED,),
    Mode.DISAGGREGATED: (Phase.PREFILL, Phase.DECODE),
    Mode.CONDITIONAL: (Phase.COLOCATED, Phase.PREFILL, Phase.DECODE),
}


def prefill(worker_id: str, **kw: Any) -> WorkerView:
    return view(worker_id, WorkerRole.PREFILL, **{**MEASURED, **kw})


def mixed(worker_id: str, **kw: Any) -> WorkerView:
    return view(worker_id, WorkerRole.MIXED, **{**MEASURED, **kw})


def decode(worker_id: str, **kw: Any) -> WorkerView:
    return view(worker_id, WorkerRole.DECODE, **{**MEASURED, **kw})


def demands(
    prompt: int, mode: Mode, cached: Mapping[str, int] | None = None
) -> dict[Phase, Demand]:
    lookup: Callable[[str], int] | None = None
    if cached is not None:
        table = dict(cached)
        lookup = lambda worker_id: table.get(worker_id, 0)  # noqa: E731
    return {ph: Demand(prompt, 32, ph, lookup) for ph in PHASES[mode]}


def place(
    views: Sequence[WorkerView],
    prompt: int,
    mode: Mode = Mode.CONDITIONAL,
    *,
    policy: str = "kv_aware",
    cached: Mapping[str, int] | None = None,
    **placer: Any,
) -> Placement:
    rate = placer.pop("arrivals_per_s", 0.0)
    out = Placer(make_policy(policy, MODEL), MODEL, CapacityLimits(), **placer).place(
        views, demands(prompt, mode, cached), mode, arrivals_per_s=rate
    )
    assert isinstance(out, Placement), out
    return out


def worker_ids(p: Placement) -> tuple[str, ...]:
    return tuple(v.id for v in p.plan.workers)


# -- conditional disaggregation ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["kv_aware", "least_loaded", "round_robin"])
def test_a_short_prompt_runs_colocated_beside_the_decodes(policy: str) -> None:
    views = [prefill("p"), mixed("m", running_seqs=6)]
    p = place(views, 80, policy=policy)
    assert p.plan.mode is Mode.COLOCATED and worker_ids(p) == ("m",)
    assert p.decision.reason is Reason.COST and not p.decision.long_prompt
    # Its TTFT is about the same either way; colocated adds no prefill step, transfer or call.
    assert p.decision.colocated_ttft_s is not None and p.decision.disaggregated_ttft_s is not None
    assert p.decision.stall_s > 0  # it rides on the decode step


@pytest.mark.parametrize("policy", ["kv_aware", "least_loaded", "round_robin"])
def test_a_long_prompt_goes_to_the_prefill_worker_when_streams_would_stall(policy: str) -> None:
    views = [prefill("p"), mixed("m", running_seqs=6)]
    p = place(views, 2000, policy=policy)
    assert p.plan.mode is Mode.DISAGGREGATED and worker_ids(p) == ("p", "m")
    assert p.decision.reason is Reason.ITL and p.decision.long_prompt
    assert p.decision.stall_s == pytest.approx(0.0)  # a prefill worker decodes nothing


def test_at_low_load_even_a_long_prompt_runs_colocated() -> None:
    # Nothing decodes on the mixed worker: no stream to stall; colocated skips the transfer.
    p = place([prefill("p"), mixed("m")], 2000)
    assert p.plan.mode is Mode.COLOCATED and p.decision.reason is Reason.COST


def test_under_load_a_long_prompt_stays_off_an_idle_mixed_worker() -> None:
    # Nothing decodes there now, but at 2 requests/s about one stream would start during its
    # 0.6 s prefill and wait behind it.
    views = [prefill("p"), mixed("m")]
    p = place(views, 2000, arrivals_per_s=2.0)
    assert p.plan.mode is Mode.DISAGGREGATED and p.decision.reason is Reason.ITL
    assert place(views, 2000, arrivals_per_s=0.2).plan.mode is Mode.COLOCATED


def test_unmeasured_workers_are_assumed_as_fast_as_their_peers() -> None:
    # "m" has not prefilled a long prompt yet (no per-token figure); its peer has.
    # A prior of 1 us per token would let its 2000 tokens ride on a decode step; the peer's
    # 0.3 ms per token says they would stall the streams for 0.6 s.
    unmeasured = mixed("m", running_seqs=4, prefill_token_s=0.0)
    optimist = CostModel(prior_prefill_token_s=1e-6)
    placer = Placer(make_policy("kv_aware", optimist), optimist, CapacityLimits())
    p = placer.place([prefill("p"), unmeasured], demands(2000, Mode.CONDITIONAL), Mode.CONDITIONAL)
    assert isinstance(p, Placement)
    assert p.plan.mode is Mode.DISAGGREGATED and p.decision.reason is Reason.ITL


def test_kv_aware_avoids_a_decode_worker_stuck_behind_a_long_prefill() -> None:
    views = [prefill("p"), mixed("m1", queued_tokens=2000), mixed("m2", running_seqs=5)]
    assert worker_ids(place(views, 2000, Mode.DISAGGREGATED))[1] == "m2"


def test_a_busy_prefill_queue_sends_a_short_prompt_colocated_and_a_slow_link_too() -> None:
    busy = prefill("p", queued_tokens=6000)
    assert place([busy, mixed("m", running_seqs=3)], 300).plan.mode is Mode.COLOCATED
    # An idle prefill worker beyond a slow link: moving the KV costs more than computing here.
    far = prefill("far", host="node-b", links=(("node-a", "direct", 5e6),))
    p = place([far, mixed("m", host="node-a", running_seqs=1)], 400)
    assert p.plan.mode is Mode.COLOCATED


def test_conditional_falls_back_to_the_only_mode_with_room() -> None:
    only_mixed = place([mixed("m", running_seqs=6)], 2000)
    assert only_mixed.plan.mode is Mode.COLOCATED
    assert only_mixed.decision.reason is Reason.ONLY_COLOCATED
    only_pd = place([prefill("p"), decode("d", running_seqs=6)], 50)
    assert only_pd.plan.mode is Mode.DISAGGREGATED
    assert only_pd.decision.reason is Reason.ONLY_DISAGGREGATED


def test_a_fallback_that_would_stall_streams_is_refused() -> None:
    # The prefill worker's queue is full; colocating 2000 tokens next to 6 streams would
    # stall them for 0.6 s: refused as "prefill full", not admitted to break every stream.
    full = prefill("p", queued_tokens=7000)
    placer = Placer(make_policy("kv_aware", MODEL), MODEL, CapacityLimits())
    views = [full, mixed("m", running_seqs=6)]
    assert placer.place(views, demands(2000, Mode.CONDITIONAL), Mode.CONDITIONAL) == "prefill"
    # A short prompt rides along fine; asked for colocated, a long one gets it.
    assert place(views, 80).plan.mode is Mode.COLOCATED
    assert place(views, 2000, Mode.COLOCATED).plan.mode is Mode.COLOCATED
    # A lone mixed worker that could prefill has no pair at all: the fallback is all there is.
    alone = mixed("m", running_seqs=6, serves=("prefill", "decode", "colocated"))
    assert place([alone], 2000).decision.reason is Reason.ONLY_COLOCATED


def test_configured_modes_are_kept() -> None:
    views = [prefill("p"), mixed("m")]
    assert place(views, 80, Mode.DISAGGREGATED).decision.reason is Reason.CONFIGURED
    assert place(views, 80, Mode.DISAGGREGATED).plan.mode is Mode.DISAGGREGATED
    assert place(views, 2000, Mode.COLOCATED).plan.mode is Mode.COLOCATED


def test_nothing_fits_names_the_phase() -> None:
    placer = Placer(make_policy("kv_aware", MODEL), MODEL, CapacityLimits())
    full = decode("d", kv_blocks_free=0)
    assert (
        placer.place([prefill("p"), full], demands(50, Mode.DISAGGREGATED), Mode.DISAGGREGATED)
        == "decode"
    )
    assert (
        placer.place([decode("d")], demands(50, Mode.DISAGGREGATED), Mode.DISAGGREGATED)
        == "prefill"
    )
    assert placer.place([prefill("p")], demands(50, Mode.COLOCATED), Mode.COLOCATED) == "colocated"


# -- KV-aware placement --------------------------------------------------------------------------


def test_kv_aware_prefers_the_worker_caching_the_prompt() -> None:
    views = [mixed("a", running_seqs=2), mixed("b", running_seqs=2)]
    p = place(views, 1200, Mode.COLOCATED, cached={"b": 1152})
    assert worker_ids(p) == ("b",) and p.decision.cached_tokens == 1152


def test_kv_aware_weighs_cached_blocks_against_load() -> None:
    # "b" caches the prompt but has 4000 tokens queued: computing 1200 on idle "a" is sooner.
    views = [mixed("a"), mixed("b", queued_tokens=4000)]
    assert worker_ids(place(views, 1200, Mode.COLOCATED, cached={"b": 1152})) == ("a",)
    assert worker_ids(place(views, 1200, Mode.COLOCATED, cached={"b": 1152},
                            policy="least_loaded")) == ("a",)  # fmt: skip


def test_least_loaded_ignores_the_cache() -> None:
    views = [mixed("a", kv_blocks_free=900), mixed("b", kv_blocks_free=800)]
    p = place(views, 1200, Mode.COLOCATED, cached={"b": 1152}, policy="least_loaded")
    assert worker_ids(p) == ("a",)


def test_kv_aware_decode_prefers_the_shortest_decode_step() -> None:
    views = [prefill("p"), decode("d1", running_seqs=40), decode("d2", running_seqs=3)]
    assert worker_ids(place(views, 500, Mode.DISAGGREGATED)) == ("p", "d2")


# -- affinity ------------------------------------------------------------------------------------


def test_affinity_prefers_the_same_host_pair_when_loads_are_close() -> None:
    d = decode("d", host="node-a")
    near = prefill("near", host="node-a", queued_tokens=100)  # ~40 ms of queue
    far = prefill("far", host="node-b", links=(("node-a", "direct", 2e8),))  # ~80 ms to move
    for policy in ("least_loaded", "kv_aware"):
        assert worker_ids(place([far, near, d], 2000, Mode.DISAGGREGATED, policy=policy)) == (
            "near",
            "d",
        ), policy


def test_affinity_gives_way_when_the_near_worker_is_much_busier() -> None:
    d = decode("d", host="node-a")
    near = prefill("near", host="node-a", queued_tokens=8000)
    far = prefill("far", host="node-b")
    for policy in ("least_loaded", "kv_aware"):
        got = worker_ids(place([far, near, d], 2000, Mode.DISAGGREGATED, policy=policy))
        assert got == ("far", "d"), policy


# -- lanes ---------------------------------------------------------------------------------------


def test_long_prompts_go_to_the_long_lane_and_short_ones_avoid_it() -> None:
    long_lane = prefill("long", lane="long", queued_tokens=2000)
    short_lane = prefill("short", lane="short")
    d = decode("d")
    views = [long_lane, short_lane, d]
    assert worker_ids(place(views, 2000, Mode.DISAGGREGATED, long_prompt_tokens=512))[0] == "long"
    assert worker_ids(place(views, 100, Mode.DISAGGREGATED, long_prompt_tokens=512))[0] == "short"


def test_a_short_prompt_borrows_an_idle_long_lane() -> None:
    views = [prefill("long", lane="long"), prefill("short", lane="short", queued_tokens=3000),
             decode("d")]  # fmt: skip
    got = place(views, 100, Mode.DISAGGREGATED, long_prompt_tokens=512)
    assert worker_ids(got)[0] == "long"


def test_the_default_threshold_comes_from_the_cost_model() -> None:
    p = place([prefill("p"), mixed("m")], 100)
    assert p.decision.long_prompt_tokens == int(0.075 / 0.0003)


# -- admission -----------------------------------------------------------------------------------


def test_admission_refuses_a_request_late_everywhere() -> None:
    slow = {"prefill_token_s": 0.0005, "queued_tokens": 6000}  # 3 s queued + 1 s to compute
    views = [prefill("p", **slow), mixed("m", **slow)]
    placer = Placer(make_policy("kv_aware", MODEL), MODEL, CapacityLimits(), ttft_slo_s=3.0)
    out = placer.place(views, demands(2000, Mode.CONDITIONAL), Mode.CONDITIONAL)
    assert isinstance(out, Refusal)
    assert out.best_ttft_s > 3.0 and out.slo_s == 3.0
    assert "prompt tokens queued ahead" in out.details


def test_admission_admits_when_one_candidate_is_on_time() -> None:
    views = [
        prefill("p", prefill_token_s=0.0005, queued_tokens=6000),
        mixed("m", queued_tokens=100),
    ]
    placer = Placer(make_policy("kv_aware", MODEL), MODEL, CapacityLimits(), ttft_slo_s=3.0)
    out = placer.place(views, demands(2000, Mode.CONDITIONAL), Mode.CONDITIONAL)
    assert isinstance(out, Placement)


def test_admission_ignores_a_placement_that_would_stall_streams() -> None:
    # Colocated on "m" would be on time but stall its 6 streams; the prefill worker, the
    # placement the decision takes, is 4 s behind: refused.
    views = [prefill("p", prefill_token_s=0.0005, queued_tokens=6000), mixed("m", running_seqs=6)]
    placer = Placer(make_policy("kv_aware", MODEL), MODEL, CapacityLimits(), ttft_slo_s=3.0)
    out = placer.place(views, demands(2000, Mode.CONDITIONAL), Mode.CONDITIONAL)
    assert isinstance(out, Refusal) and "disaggregated on p" in out.details
    # A short prompt colocates on time: admitted.
    assert isinstance(placer.place(views, demands(80, Mode.CONDITIONAL), Mode.CONDITIONAL),
                      Placement)  # fmt: skip


def test_admission_never_refuses_on_priors() -> None:
    unmeasured = {"prefill_token_s": 0.0, "step_overhead_s": 0.0}
    views = [prefill("p", queued_tokens=6000, **unmeasured), decode("d")]  # 1.5 s by the prior
    placer = Placer(make_policy("kv_aware", MODEL), MODEL, CapacityLimits(), ttft_slo_s=0.5)
    out = placer.place(views, demands(2000, Mode.DISAGGREGATED), Mode.DISAGGREGATED)
    assert isinstance(out, Placement)


def test_admission_counts_cached_tokens() -> None:
    # 9000 tokens to compute miss a 3 s SLO; with 8900 of them cached, 100 do not.
    views = [mixed("m")]
    placer = Placer(make_policy("kv_aware", MODEL), MODEL, CapacityLimits(), ttft_slo_s=1.0)
    cold = placer.place(views, demands(9000, Mode.COLOCATED), Mode.COLOCATED)
    warm = placer.place(views, demands(9000, Mode.COLOCATED, {"m": 8900}), Mode.COLOCATED)
    assert isinstance(cold, Refusal) and isinstance(warm, Placement)


# -- capacity and roles still apply ---------------------------------------------------------------


def test_switching_and_draining_workers_take_no_new_work() -> None:
    draining = mixed("m1", draining=True)
    switching = mixed("m2", serves=(), duty="prefill", switching=True)
    ok = mixed("m3", running_seqs=40)
    assert worker_ids(place([draining, switching, ok], 50, Mode.COLOCATED)) == ("m3",)
    prefill_duty = mixed("m4", serves=("prefill",), duty="prefill")
    got = place([prefill_duty, decode("d")], 2000, Mode.CONDITIONAL)
    assert worker_ids(got) == ("m4", "d")
