"""The supervisor on real child processes and a real Redis, driven by a fake clock: restarts
on the same port after a doubling backoff, a crash loop given up (fatal or not), Redis
restarted on its port."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pdserve.errors import InvalidArgumentError
from pdserve.redis_server import EmbeddedRedis
from pdserve.service_process import ServiceProcess, terminate
from pdserve.supervisor import REDIS, RestartPolicy, Supervisor

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
POLICY = RestartPolicy(
    initial_backoff_s=1.0, max_backoff_s=8.0, stable_after_s=100.0,
    crash_loop_restarts=3, crash_loop_window_s=60.0,
)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def child(tmp_path: Path, name: str, *args: str, role: str | None = None) -> ServiceProcess:
    return ServiceProcess(
        name, "tests.integration.supervised_child", list(args),
        port_file=tmp_path / f"{name}.port", log_file=tmp_path / f"{name}.log", role=role,
    )  # fmt: skip


@pytest.fixture
def services() -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    yield started
    terminate([s.proc for s in started if s.proc is not None], 5.0)


def wait_for_port_file(service: ServiceProcess) -> int:
    """The port the child wrote (it writes it once it runs); fails if it exits first."""
    assert service.proc is not None
    while not service.port_file.exists():
        assert service.proc.poll() is None, service.log_tail()
        try:
            service.proc.wait(timeout=0.05)  # polling a child process: nothing to block on
        except subprocess.TimeoutExpired:  # still running: look again
            continue
    return int(service.port_file.read_text())


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [POLICY.backoff_s(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    with pytest.raises(InvalidArgumentError):
        RestartPolicy(multiplier=0.5)
    with pytest.raises(InvalidArgumentError):
        RestartPolicy(crash_loop_restarts=-1)


def test_a_killed_service_comes_back_on_its_port_after_the_backoff(
    tmp_path: Path, services: list[ServiceProcess]
) -> None:
    svc = child(tmp_path, "router")
    services.append(svc)
    svc.spawn(ENV, port=45123)
    svc.port = wait_for_port_file(svc)
    clock, lines = Clock(), []
    sup = Supervisor([svc], ENV, policy=POLICY, announce=lines.append, clock=clock)
    assert svc.proc is not None
    first = svc.proc.pid
    for round_ in (1, 2):
        svc.proc.send_signal(signal.SIGKILL)
        svc.proc.wait()
        sup.tick()  # notices the exit
        assert "killed by signal 9" in lines[-1]
        clock.now += POLICY.backoff_s(round_) - 0.01
        sup.tick()
        assert svc.proc.poll() is not None  # not yet: the backoff runs
        clock.now += 0.01
        sup.tick()
        assert svc.proc.pid != first and svc.proc.poll() is None
        assert wait_for_port_file(svc) == 45123  # the same port, so its address stays valid
        assert sup.restarts("router") == round_
    assert not sup.fatal.is_set()


def test_a_crash_loop_is_given_up_and_fatal_without_a_spare(
    tmp_path: Path, services: list[ServiceProcess]
) -> None:
    svc = child(tmp_path, "scheduler", "--exit", "3")
    services.append(svc)
    svc.spawn(ENV)
    clock, lines = Clock(), []
    sup = Supervisor([svc], ENV, policy=POLICY, announce=lines.append, clock=clock)
    delays = []
    while not sup.given_up():
        assert svc.proc is not None
        svc.proc.wait()
        sup.tick()
        record = sup.records["scheduler"]
        if record.restart_at is not None:
            delays.append(record.restart_at - clock.now)
            clock.now = record.restart_at
            sup.tick()
    assert delays == [1.0, 2.0, 4.0]  # then a fourth exit within the window: given up
    assert sup.restarts("scheduler") == POLICY.crash_loop_restarts
    assert "giving up" in lines[-1] and "cannot serve without it" in lines[-1]
    assert sup.fatal.is_set()


def test_a_worker_with_a_live_peer_is_given_up_without_stopping_the_cluster(
    tmp_path: Path, services: list[ServiceProcess]
) -> None:
    bad = child(tmp_path, "decode-0", "--exit", "1", role="decode")
    good = child(tmp_path, "decode-1", role="decode")
    services += [bad, good]
    for s in services:
        s.spawn(ENV)
    policy = RestartPolicy(initial_backoff_s=1.0, crash_loop_restarts=0)
    sup = Supervisor(services, ENV, policy=policy, clock=Clock())
    assert bad.proc is not None
    bad.proc.wait()
    sup.tick()
    assert sup.given_up() == ["decode-0"] and not sup.fatal.is_set()


def test_a_stable_run_starts_the_backoff_over(
    tmp_path: Path, services: list[ServiceProcess]
) -> None:
    svc = child(tmp_path, "kvstore")
    services.append(svc)
    svc.spawn(ENV)
    clock = Clock()
    sup = Supervisor([svc], ENV, policy=POLICY, clock=clock)
    for expected in (1.0, 2.0, 1.0):
        assert svc.proc is not None
        if expected == 1.0 and sup.restarts("kvstore"):
            clock.now += POLICY.stable_after_s  # it ran long enough this time
        svc.proc.kill()
        svc.proc.wait()
        sup.tick()
        restart_at = sup.records["kvstore"].restart_at
        assert restart_at is not None and restart_at - clock.now == expected
        clock.now = restart_at
        sup.tick()


def test_the_embedded_redis_is_restarted_on_its_port() -> None:
    with EmbeddedRedis() as server:
        url = server.url
        client = redis.Redis.from_url(url, socket_timeout=2)
        client.set("k", "v")
        clock = Clock()
        sup = Supervisor([], ENV, redis=server, policy=POLICY, clock=clock)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        while server.running:  # the kill lands asynchronously
            sup.tick()
        sup.tick()
        clock.now += POLICY.initial_backoff_s
        sup.tick()
        assert server.running and server.url == url and sup.restarts(REDIS) == 1
        assert client.ping() and client.get("k") is None  # back, and empty
        client.close()


def test_the_thread_restarts_until_halted(tmp_path: Path, services: list[ServiceProcess]) -> None:
    svc = child(tmp_path, "router")
    services.append(svc)
    svc.spawn(ENV, port=45124)
    svc.port = wait_for_port_file(svc)
    policy = RestartPolicy(initial_backoff_s=0.01, poll_s=0.01)
    sup = Supervisor([svc], ENV, policy=policy)
    sup.start()
    try:
        assert svc.proc is not None
        svc.proc.kill()
        svc.proc.wait()
        deadline = time.monotonic() + 30
        while sup.restarts("router") == 0:  # the thread restarts it; poll its count
            assert time.monotonic() < deadline, "no restart"
            time.sleep(0.01)
        assert wait_for_port_file(svc) == 45124
        sup.halt()
        svc.proc.kill()
        svc.proc.wait()
        assert sup.restarts("router") == 1  # halted: no more restarts
    finally:
        terminate([s.proc for s in services if s.proc is not None], 5.0)
        sup.finish()
