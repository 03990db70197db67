"""The workers' OpenMP wait policy: one definition for the launcher, the benchmarks and the
calibration that must measure the steps the workers take."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.compute.omp import (
    OMP_WAIT_POLICY,
    WORKER_WAIT_POLICY,
    adopt_worker_wait_policy,
    worker_omp_env,
)
from pdserve.launcher.cluster import Cluster


def test_service_env_defaults_the_policy_and_keeps_a_chosen_one() -> None:
    env = worker_omp_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", OMP_WAIT_POLICY: WORKER_WAIT_POLICY}
    assert worker_omp_env({OMP_WAIT_POLICY: "ACTIVE"})[OMP_WAIT_POLICY] == "ACTIVE"


def test_adopting_sets_only_an_unset_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OMP_WAIT_POLICY, "ACTIVE")
    assert adopt_worker_wait_policy() == "ACTIVE"
    monkeypatch.delenv(OMP_WAIT_POLICY)
    assert adopt_worker_wait_policy() == WORKER_WAIT_POLICY


def test_cluster_services_start_with_the_workers_policy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(OMP_WAIT_POLICY, raising=False)
    assert Cluster(tmp_path).child_env()[OMP_WAIT_POLICY] == WORKER_WAIT_POLICY
    monkeypatch.setenv(OMP_WAIT_POLICY, "ACTIVE")  # the caller's choice stands
    assert Cluster(tmp_path).child_env()[OMP_WAIT_POLICY] == "ACTIVE"
