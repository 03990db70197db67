"""A Redis master, its replica and three sentinels as local processes, for failover tests.

``with SentinelGroup(password="pw") as g: connect(g.url) ...; g.kill_master(); g.promoted()``.
Everything runs the same redis-server binary the embedded Redis uses (a sentinel is that
binary with ``--sentinel``). The sentinels judge the master down after half a second, so a
failover takes about a second here; a quorum of two out of three must agree.
"""

from __future__ import annotations

import os
import signal
import time
from types import TracebackType

import redis

from pdserve.redis_server import EmbeddedRedis

SERVICE = "pdserve"
DOWN_AFTER_MS = 500
_POLL_S = 0.05


class SentinelGroup:
    def __init__(self, *, password: str, sentinels: int = 3) -> None:
        self.password = password
        self.master = EmbeddedRedis(password=password)
        self.replica: EmbeddedRedis | None = None
        self.sentinels: list[EmbeddedRedis] = []
        self._count = sentinels

    def start(self, timeout_s: float = 30.0) -> SentinelGroup:
        pw = self.password
        self.master.start()
        self.replica = EmbeddedRedis(
            password=pw, config=[f"replicaof 127.0.0.1 {self.master.port}", f"masterauth {pw}"]
        ).start()
        watch = [
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2",
            f"sentinel auth-pass {SERVICE} {pw}",
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE} 5000",
        ]
        self.sentinels = [
            EmbeddedRedis(config=watch, sentinel=True).start() for _ in range(self._count)
        ]
        self._until(self._ready, "the replica in sync and known to every sentinel", timeout_s)
        return self

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://:{self.password}@{hosts}/{SERVICE}/0"

    def master_port(self) -> int:
        """The master's port as the first live sentinel reports it."""
        for s in self.sentinels:
            if s.running:
                client = redis.Redis(port=s.port, socket_timeout=2)
                try:
                    _host, port = client.sentinel_get_master_addr_by_name(SERVICE)
                    return int(port)
                finally:
                    client.close()
        raise AssertionError("no sentinel is running")

    def kill_master(self) -> int:
        """SIGKILL the current master (no shutdown, no last write); its port."""
        port = self.master_port()
        victim = next(r for r in (self.master, self.replica) if r is not None and r.port == port)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        return port

    def promoted(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Wait until every live sentinel names a new master that answers as one; its port."""

        def done() -> bool:
            ports = {self._sentinel(s).sentinel_get_master_addr_by_name(SERVICE)[1]
                     for s in self.sentinels if s.running}  # fmt: skip
            if len(ports) != 1 or int(next(iter(ports))) == old_port:
                return False
            info = self._client(int(next(iter(ports)))).info("replication")
            return bool(info["role"] == "master")

        self._until(done, "a replica promoted by the sentinels", timeout_s)
        return self.master_port()

    def stop(self) -> None:
        for r in [*self.sentinels, self.replica, self.master]:
            if r is not None:
                r.stop()

    # -- internals -----------------------------------------------------------------------------

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=self.password, socket_timeout=2)

    @staticmethod
    def _sentinel(s: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(port=s.port, socket_timeout=2)

    def _ready(self) -> bool:
        assert self.replica is not None
        info = self._client(self.replica.port).info("replication")
        if info.get("master_link_status") != "up":
            return False
        for s in self.sentinels:
            replicas = self._sentinel(s).sentinel_slaves(SERVICE)
            if not any(int(r["port"]) == self.replica.port for r in replicas):
                return False
        return True

    @staticmethod
    def _until(check: object, what: str, timeout_s: float) -> None:
        assert callable(check)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except redis.RedisError:
                pass  # a server between roles; asked again at the next poll
            time.sleep(_POLL_S)  # polling other processes: nothing to wait on
        raise AssertionError(f"timed out waiting for {what}")

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
