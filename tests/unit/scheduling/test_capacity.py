"""Capacity arithmetic and the reservation member encoding."""

from __future__ import annotations

import math

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import (
    CapacityLimits,
    Claim,
    Demand,
    Phase,
    WorkerView,
    ineligibility,
    shortfall,
    stale,
)
from pdserve.scheduling.reservations import decode_member, encode_member, live_claims
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole

from .factories import view


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "block_size"), [(1, 1, 16), (16, 16, 16), (17, 100, 16), (1000, 1, 32)]
)
def test_claims_follow_the_block_arithmetic(prompt: int, max_tokens: int, block_size: int) -> None:
    prefill = Demand(prompt, max_tokens, Phase.PREFILL).claim(block_size)
    decode = Demand(prompt, max_tokens, Phase.DECODE).claim(block_size)
    colocated = Demand(prompt, max_tokens, Phase.COLOCATED).claim(block_size)
    whole = math.ceil((prompt + max_tokens) / block_size)
    assert prefill == Claim(tokens=prompt, blocks=math.ceil(prompt / block_size))
    assert decode == Claim(tokens=0, blocks=whole)
    assert colocated == Claim(tokens=prompt, blocks=whole)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "field"), [(0, 1, "prompt_tokens"), (1, 0, "max_tokens")]
)
def test_demand_rejects_empty_requests(prompt: int, max_tokens: int, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        Demand(prompt, max_tokens, Phase.DECODE)
    assert err.value.field == field


def test_blocks_count_reservations_on_top_of_the_heartbeat() -> None:
    limits = CapacityLimits()
    v = view("d", kv_blocks_free=10, reserved_blocks=6)
    assert shortfall(v, Claim(blocks=4), limits) is None
    assert "needs 5 KV blocks" in (shortfall(v, Claim(blocks=5), limits) or "")


def test_prefill_queue_limit_and_the_idle_exception() -> None:
    limits = CapacityLimits(prefill_queue_batches=2.0)  # 2 * 512 = 1024 pending tokens at most
    busy = view("p", WorkerRole.PREFILL, queued_tokens=600, reserved_tokens=300)
    assert shortfall(busy, Claim(tokens=124), limits) is None
    assert shortfall(busy, Claim(tokens=125), limits) is not None
    idle = view("p", WorkerRole.PREFILL)
    assert shortfall(idle, Claim(tokens=50_000), limits) is None


def test_ineligibility_reasons() -> None:
    assert ineligibility(view("d"), Phase.DECODE, None) is None
    assert "role" in (ineligibility(view("d"), Phase.PREFILL, None) or "")
    assert ineligibility(view("d", draining=True), Phase.DECODE, None) == "draining"
    assert "fingerprint" in (ineligibility(view("d"), Phase.DECODE, "other-model") or "")
    assert ineligibility(view("m", WorkerRole.MIXED), Phase.COLOCATED, None) is None


def test_member_encoding_round_trips() -> None:
    member = encode_member("abc123", Claim(tokens=7, blocks=3))
    assert decode_member(member) == ("abc123", Claim(7, 3))
    assert decode_member(member.encode()) == ("abc123", Claim(7, 3))


def test_live_claims_skip_expired_and_admitted_reservations() -> None:
    entries = [
        (encode_member("expired", Claim(100, 10)), 999.0),
        (encode_member("live", Claim(5, 2)), 2000.0),
        (encode_member("admitted", Claim(50, 20)).encode(), 2000.0),  # bytes, as Redis replies
        (encode_member("also-live", Claim(1, 1)), 1000.5),
    ]
    assert live_claims(entries, now_ms=1000.0, admitted=["admitted"]) == Claim(6, 3)
    assert live_claims(entries, now_ms=1000.0) == Claim(56, 23)


@pytest.mark.parametrize(
    ("interval_s", "age_s", "gone"),
    [(0.5, 0.4, False), (0.5, 1.0, False), (0.5, 1.01, True), (0.0, 3600.0, False)],
)
def test_a_heartbeat_two_intervals_late_is_stale(
    interval_s: float, age_s: float, gone: bool
) -> None:
    info = view("d", interval_s=interval_s).info
    assert stale(WorkerView(info, heartbeat_age_s=age_s)) is gone


def test_heartbeat_interval_round_trips_and_is_checked() -> None:
    info = view("d", interval_s=0.25).info
    assert WorkerInfo.from_json(info.to_json()).interval_s == 0.25
    with pytest.raises(InvalidArgumentError) as err:
        view("d", interval_s="soon")
    assert err.value.field == "interval_s"
