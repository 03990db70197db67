"""Every service refuses to start on a port another process holds (docs/security.md).

A real cluster (simulated accelerators: no weights to load) with every kind of service: router,
scheduler, KV store, prefill and decode workers, planner and HTTP gateway. A second copy of each
is started with the same flags on the port the first serves: it must exit with status 1 and one
line naming the address, no traceback, and the cluster must serve on as before. gRPC's default
on Linux is SO_REUSEPORT, with which the second router bound the port too and took half the
connections.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.client import Client
from pdserve.launcher import Cluster
from pdserve.models.demo import init_checkpoint
from pdserve.service_process import ServiceProcess

pytestmark = pytest.mark.integration

HELD = "another process holds this port"
EXIT_TIMEOUT_S = 120.0
"""Bound on a refused copy's life: its start-up (imports, tokenizer, engine) until the bind."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model_dir = init_checkpoint(tmp_path_factory.mktemp("ports_model"), "tiny", dtype="float32")
    with Cluster(
        model_dir, backend="sim", num_prefill=1, num_decode=1, planner=True, http_port=0,
        worker_args=("--sim-profile", "roofline:h100:llama-3-8b"), log_level="WARNING",
    ) as c:  # fmt: skip
        yield c


def copy_of(service: ServiceProcess, log_dir: Path, extra: list[str]) -> ServiceProcess:
    """``service``'s command line again, with its own files; ``extra`` last (the last of a flag
    wins), so its metrics port and files are its own."""
    name = f"{service.name}-copy"
    metrics = ["--metrics-port", "0", "--metrics-port-file", str(log_dir / f"{name}.metrics")]
    return ServiceProcess(
        name,
        service.module,
        [*service.args, *metrics, *extra],
        port_file=log_dir / f"{name}.port",
        log_file=log_dir / f"{name}.log",
    )


def wait_exit(copies: list[ServiceProcess]) -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for c in copies:
        assert c.proc is not None
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
            pytest.fail(f"{c.name} still runs on a held port; its log:\n{c.log_tail()}")


def test_a_second_copy_of_any_service_exits_with_one_line(cluster: Cluster, tmp_path: Path) -> None:
    originals = list(cluster.services)
    assert {s.module for s in originals} == {
        "services.router", "services.scheduler", "services.kvstore", "services.prefill",
        "services.decode", "services.planner", "services.gateway",
    }  # fmt: skip
    copies = []
    for s in originals:
        assert s.port is not None
        copy = copy_of(s, tmp_path, ["--port", str(s.port)])
        copy.spawn(cluster.child_env(), port=s.port)
        copies.append(copy)
    wait_exit(copies)
    for s, c in zip(originals, copies, strict=True):
        assert c.proc is not None and c.proc.returncode == 1, c.log_tail()
        log = c.log_file.read_text()
        assert "Traceback" not in log, log
        last = log.splitlines()[-1]
        assert last.endswith(f"cannot listen on 127.0.0.1:{s.port}: {HELD}"), log
        assert not c.port_file.exists()
    for s in originals:  # every first one serves on, and alone
        assert s.proc is not None and s.proc.poll() is None, s.log_tail()
        assert s.is_healthy(), s.name
    with Client(cluster.router_address) as client:
        done = client.generate([5, 6, 7], max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4


def test_a_held_metrics_port_is_one_line_too(cluster: Cluster, tmp_path: Path) -> None:
    kvstore = next(s for s in cluster.services if s.module == "services.kvstore")
    taken = cluster.metrics_ports["router"]
    copy = copy_of(kvstore, tmp_path, ["--metrics-port", str(taken)])
    copy.spawn(cluster.child_env(), port=0)
    wait_exit([copy])
    assert copy.proc is not None and copy.proc.returncode == 1, copy.log_tail()
    log = copy.log_file.read_text()
    assert "Traceback" not in log, log
    assert log.splitlines()[-1] == (
        f"kvstore: cannot listen on http://127.0.0.1:{taken}/metrics: {HELD}"
    )
