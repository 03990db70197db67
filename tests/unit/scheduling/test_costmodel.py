"""The cost model's predictions from heartbeat figures (fake worker views)."""

from __future__ import annotations

import math

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import WorkerView
from pdserve.scheduling.costmodel import CostModel, decoding
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.transfer.handle import TransportKind
from pdserve.transfer.links import Handoff

from .factories import view, worker

MODEL = CostModel(itl_slo_s=0.150)


def test_prefill_time_counts_steps_and_tokens_from_the_measured_model() -> None:
    info = worker("p", WorkerRole.PREFILL, max_batch_tokens=512,
                  step_overhead_s=0.004, prefill_token_s=0.0003)  # fmt: skip
    expected = math.ceil(1200 / 512) * 0.004 + 1200 * 0.0003
    assert MODEL.prefill_s(info, 1200) == pytest.approx(expected)
    assert MODEL.prefill_s(info, 0) == 0.0
    assert MODEL.measured(info)


def test_unmeasured_terms_take_the_priors() -> None:
    info = worker("p", WorkerRole.PREFILL, max_batch_tokens=512)
    assert not MODEL.measured(info)
    expected = MODEL.prior_step_overhead_s + 100 * MODEL.prior_prefill_token_s
    assert MODEL.prefill_s(info, 100) == pytest.approx(expected)


def test_queue_wait_covers_queued_and_reserved_tokens() -> None:
    v = view("p", WorkerRole.PREFILL, queued_tokens=300, reserved_tokens=200,
             max_batch_tokens=4096, step_overhead_s=0.001, prefill_token_s=0.001)  # fmt: skip
    assert MODEL.queue_s(v) == pytest.approx(0.001 + 500 * 0.001)


def test_transfer_uses_the_link_the_prefill_worker_measured() -> None:
    prefill = worker("p", WorkerRole.PREFILL, host="a", kv_bytes_per_token=1000,
                     links=(("a", "shm", 2e9), ("b", "direct", 1e8)))  # fmt: skip
    same_host = worker("d1", host="a")
    other_host = worker("d2", host="b")
    unknown = worker("d3", host="c")
    assert MODEL.handoff(prefill, same_host, 1000).kind is TransportKind.SHM
    # Each transfer: 1 ms latency + 1 MB over the link measured, else the prior (1 GB/s).
    assert MODEL.transfer_s(prefill, same_host, 1000) == pytest.approx(0.001 + 1e6 / 2e9)
    assert MODEL.transfer_s(prefill, other_host, 1000) == pytest.approx(0.001 + 1e6 / 1e8)
    assert MODEL.transfer_s(prefill, unknown, 1000) == pytest.approx(0.001 + 1e6 / 1e9)
    assert MODEL.transfer_s(worker("x", WorkerRole.PREFILL), unknown, 1000) == 0.0  # no size


def test_the_hand_off_is_priced_on_the_transports_the_prefill_worker_allows() -> None:
    def handoff(transports: tuple[str, ...], **measured: float) -> Handoff:
        prefill = worker("p", WorkerRole.PREFILL, host="a", kv_bytes_per_token=100_000,
                         transports=transports, **measured)  # fmt: skip
        return MODEL.handoff(prefill, worker("d", host="a"), 1000)

    assert handoff(()).kind is TransportKind.SHM  # an older heartbeat: the default policy
    assert handoff(("direct", "recompute")).kind is TransportKind.DIRECT  # --no-shm
    assert handoff(("store",)).seconds == pytest.approx(0.001 + 1e8 / 0.5e9)  # forced store
    # 100 MB at 1 GB/s (0.101 s) against 10 ms + 1000 tokens at 20 us (0.03 s): recompute,
    # once the worker has measured its prefills.
    fast = handoff(("direct", "recompute"), prefill_token_s=2e-5, step_overhead_s=0.01)
    assert fast == Handoff(TransportKind.RECOMPUTE, pytest.approx(0.03))


def test_a_long_prefill_harms_the_streams_of_a_worker_that_decodes() -> None:
    busy = view("m", WorkerRole.MIXED, running_seqs=8, max_batch_tokens=2048,
                step_overhead_s=0.01, decode_seq_s=0.001, prefill_token_s=0.0003)  # fmt: skip
    assert MODEL.harms_itl(busy, 2000)  # 0.6 s of prefill in one step
    assert not MODEL.harms_itl(busy, 100)  # 30 ms fits the 150 ms SLO
    idle = view("m2", WorkerRole.MIXED, prefill_token_s=0.0003)
    assert not MODEL.harms_itl(idle, 2000)  # nobody decodes there, nobody arrives
    busy_cluster = MODEL.calibrated([idle], arrivals_per_s=4.0)
    assert busy_cluster.harms_itl(idle, 2000)  # streams would start during its 0.6 s
    prefill_only = view("p", WorkerRole.PREFILL, running_seqs=8, prefill_token_s=0.0003)
    assert decoding(prefill_only) == 0 and not MODEL.harms_itl(prefill_only, 2000)


def test_prompts_queued_ahead_share_the_step_and_its_stall() -> None:
    def mixed(queued: int) -> WorkerView:
        return view("m", WorkerRole.MIXED, running_seqs=4, queued_tokens=queued,
                    max_batch_tokens=2048, step_overhead_s=0.01, decode_seq_s=0.001,
                    prefill_token_s=0.0003)  # fmt: skip

    assert not MODEL.harms_itl(mixed(0), 300)  # 90 ms alone fits the 150 ms SLO
    assert MODEL.stall_on(mixed(0), 300) == pytest.approx(300 * 0.0003)
    # Three medium prompts already wait: the step carrying this one carries theirs too.
    assert MODEL.harms_itl(mixed(900), 300)
    assert MODEL.stall_on(mixed(900), 300) == pytest.approx(1200 * 0.0003)
    # A step's token budget bounds it.
    assert MODEL.stall_on(mixed(5000), 300) == pytest.approx(2048 * 0.0003)


def test_a_step_that_turns_bulk_on_a_shared_host_harms_its_streams() -> None:
    def mixed(queued: int = 0, running: int = 4) -> WorkerView:
        return view("m", WorkerRole.MIXED, running_seqs=running, queued_tokens=queued,
                    max_batch_tokens=2048, step_overhead_s=0.01, decode_seq_s=0.001,
                    prefill_token_s=0.0001, interactive_tokens=256)  # fmt: skip

    assert not MODEL.harms_itl(mixed(), 200)  # an interactive step: 20 ms of prefill
    assert MODEL.harms_itl(mixed(), 300)  # 30 ms of its own, but it queues behind bulk work
    assert MODEL.harms_itl(mixed(queued=100), 200)  # the step carries the queued 100 too
    assert not MODEL.harms_itl(mixed(running=0), 300)  # no stream to stall
    unshared = view("m", WorkerRole.MIXED, running_seqs=4, max_batch_tokens=2048,
                    step_overhead_s=0.01, decode_seq_s=0.001, prefill_token_s=0.0001)  # fmt: skip
    assert not MODEL.harms_itl(unshared, 300)


def test_small_chunks_keep_a_long_prefill_within_the_itl_budget() -> None:
    chunked = view("m", WorkerRole.MIXED, running_seqs=8, max_batch_tokens=256,
                   step_overhead_s=0.01, decode_seq_s=0.001, prefill_token_s=0.0003)  # fmt: skip
    assert MODEL.stall_s(chunked.info, 2000) == pytest.approx(256 * 0.0003)
    assert not MODEL.harms_itl(chunked, 2000)


def test_disaggregated_ttft_adds_the_transfer_and_the_hop() -> None:
    link = ("b", "direct", 1e8)
    p = view("p", WorkerRole.PREFILL, host="a", kv_bytes_per_token=1000, max_batch_tokens=4096,
             step_overhead_s=0.002, prefill_token_s=0.0005, links=(link,))  # fmt: skip
    d = view("d", host="b")
    ttft = MODEL.disaggregated_ttft_s(p, d, uncached=400, moved=400)
    move = 0.001 + 400 * 1000 / 1e8  # latency + bytes / bandwidth (recomputing: 0.202 s)
    assert ttft == pytest.approx(0.002 + 400 * 0.0005 + move + MODEL.hop_s)


def test_long_prompt_threshold_follows_the_median_worker() -> None:
    views = [view(f"w{i}", WorkerRole.PREFILL, prefill_token_s=t)
             for i, t in enumerate((0.0001, 0.0005, 0.001))]  # fmt: skip
    assert MODEL.long_prompt_tokens(views) == int(0.075 / 0.0005)


def test_arrival_rate_follows_the_gaps_and_decays_when_idle() -> None:
    from pdserve.scheduling.costmodel import ArrivalRate

    rate = ArrivalRate(alpha=0.5)
    assert rate.rate(0.0) == 0.0
    for t in (0.0, 0.5, 1.0, 1.5):
        rate.arrived(t)
    assert rate.rate(1.5) == pytest.approx(2.0)
    assert rate.rate(11.5) == pytest.approx(0.1)  # 10 s without a request


@pytest.mark.parametrize("field", ["itl_slo_s", "prior_prefill_token_s"])
def test_bad_settings_name_their_field(field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        CostModel(**{field: 0})
    assert err.value.field == field
