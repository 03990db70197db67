"""Two scheduler replicas and two routers over one Redis, on simulated workers: both
routers serve, the replicas share the placements, and when one replica dies requests go on
through the other without an error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.client import Client
from pdserve.launcher import Cluster, default_model
from tests.integration.failover_load import kill
from tests.integration.metrics_probe import metric

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(
        default_model("tiny"), backend="sim", num_prefill=1, num_decode=2,
        num_schedulers=2, num_routers=2, log_level="WARNING",
        worker_args=["--sim-profile", "roofline:h100:llama-3-8b"],
    ) as c:  # fmt: skip
        yield c


def assigned(url: str) -> float:
    """Assign calls a scheduler has answered, from its metrics."""
    return metric(url, "pdserve_scheduler_decisions_total")


def test_both_routers_serve_through_both_replicas(cluster: Cluster) -> None:
    urls = [cluster.metrics_urls()[name] for name in ("scheduler", "scheduler-1")]
    before = [assigned(u) for u in urls]
    for address in cluster.router_addresses:
        with Client(address, timeout=60) as client:
            for i in range(6):
                done = client.generate([5, 6, 7, 8 + i], max_tokens=4, ignore_eos=True)
                assert done.usage.completion_tokens == 4
    after = [assigned(u) for u in urls]
    assert [a - b for a, b in zip(after, before, strict=True)] == [6, 6]


def test_requests_go_on_when_a_replica_dies(cluster: Cluster) -> None:
    victim = next(s for s in cluster.services if s.name == "scheduler-1")
    kill(victim)
    with Client(cluster.router_address, timeout=60) as client:
        for i in range(8):  # every other call would have gone to the dead replica
            done = client.generate([9, 10, 11 + i], max_tokens=3, ignore_eos=True)
            assert done.usage.completion_tokens == 3


def test_a_client_of_both_routers_spreads_its_calls_and_rides_out_one_dying(
    cluster: Cluster,
) -> None:
    urls = [cluster.metrics_urls()[name] for name in ("router", "router-1")]

    def served() -> list[float]:
        return [metric(u, "pdserve_requests_total", outcome="ok") for u in urls]

    both = ",".join(cluster.router_addresses)
    before = served()
    with Client(both, timeout=60) as client:
        for i in range(8):
            assert client.generate([3, 4, 5 + i], max_tokens=2).usage.completion_tokens == 2
        spread = [a - b for a, b in zip(served(), before, strict=True)]
        assert sum(spread) == 8 and min(spread) >= 1, spread  # round robin over the two
        kill(next(s for s in cluster.services if s.name == "router-1"))
        for i in range(8):  # none fails: the dead router is skipped
            assert client.generate([6, 7, 8 + i], max_tokens=2).usage.completion_tokens == 2
