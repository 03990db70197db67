"""Placement policies order candidates as documented; unknown names are refused."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import Demand, Phase, WorkerView
from pdserve.scheduling.policies import POLICIES, LeastLoaded, RoundRobin, make_policy
from pdserve.scheduling.worker_info import WorkerRole

from .factories import view

DECODE = Demand(prompt_tokens=100, max_tokens=50, phase=Phase.DECODE)
PREFILL = Demand(prompt_tokens=100, max_tokens=50, phase=Phase.PREFILL)


def ids(views: Sequence[WorkerView]) -> list[str]:
    return [v.id for v in views]


def test_least_loaded_decode_prefers_free_blocks_after_reservations() -> None:
    candidates = [
        view("a", kv_blocks_free=90, reserved_blocks=60),  # 30 left
        view("b", kv_blocks_free=50),  # 50 left
        view("c", kv_blocks_free=70, reserved_blocks=20, queued_tokens=10),  # 50 left, busier queue
        view("d", kv_blocks_free=40),
    ]
    assert ids(LeastLoaded().choose(candidates, DECODE)) == ["b", "c", "d", "a"]


def test_least_loaded_prefill_prefers_the_shortest_queue_in_batches() -> None:
    candidates = [
        view("slow", WorkerRole.PREFILL, queued_tokens=1000, max_batch_tokens=256),  # ~3.9 batches
        view("fast", WorkerRole.PREFILL, queued_tokens=1500, max_batch_tokens=1024),  # ~1.5 batches
        view("reserved", WorkerRole.PREFILL, reserved_tokens=600, max_batch_tokens=512),  # ~1.2
        view("idle-full", WorkerRole.PREFILL, kv_blocks_free=1),  # 0 batches, few blocks
        view("idle", WorkerRole.PREFILL, kv_blocks_free=80),  # 0 batches, more blocks
    ]
    assert ids(LeastLoaded().choose(candidates, PREFILL)) == [
        "idle",
        "idle-full",
        "reserved",
        "fast",
        "slow",
    ]


def test_least_loaded_breaks_ties_by_id() -> None:
    candidates = [view("z"), view("x"), view("y")]
    assert ids(LeastLoaded().choose(candidates, DECODE)) == ["x", "y", "z"]


def test_round_robin_rotates_per_phase_and_returns_every_candidate() -> None:
    policy = RoundRobin()
    candidates = [view("c"), view("a"), view("b")]
    firsts = [policy.choose(candidates, DECODE)[0].id for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    # The prefill rotation has its own turn counter.
    assert policy.choose(candidates, PREFILL)[0].id == "a"
    assert sorted(ids(policy.choose(candidates, DECODE))) == ["a", "b", "c"]


def test_make_policy_builds_fresh_instances() -> None:
    assert set(POLICIES) == {"round_robin", "least_loaded", "kv_aware"}
    for name in POLICIES:
        policy = make_policy(name)
        assert policy.name == name
        assert make_policy(name) is not policy


def test_unknown_policy_names_the_field_and_the_choices() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        make_policy("random")
    assert err.value.field == "policy"
    assert "least_loaded" in str(err.value) and "round_robin" in str(err.value)


def test_policy_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        POLICIES["mine"] = RoundRobin


def test_scheduling_imports_neither_torch_nor_grpc() -> None:
    code = (
        "import sys, pdserve.scheduling; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
