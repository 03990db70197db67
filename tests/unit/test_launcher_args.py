"""The command lines a ``Cluster`` gives its services (``launcher.args``): a worker's parse, with
the worker's own parser, into the options the cluster asked for, the caller's flags and the
role's coming last; and the replica names and security flags."""

from __future__ import annotations

from pathlib import Path

from pdserve.launcher import args as cmd
from pdserve.launcher.args import is_replica, replica_name
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.security.certs import make_certs
from pdserve.worker.options import WorkerOptions, options_from_args, worker_parser


def parse(role: WorkerRole, args: list[str]) -> WorkerOptions:
    roles = [WorkerRole.PREFILL] if role is WorkerRole.PREFILL else [WorkerRole.DECODE, role]
    parser = worker_parser("w", None, roles=roles, default_max_wait_ms=0.0, env={})
    return options_from_args(parser.parse_args(args))


def test_worker_command_lines_give_the_options_asked_for() -> None:
    common = cmd.worker_args(
        Path("/m"), "ns", "kv:1", "torch", host_lease=Path("/lease"), kv_cache_bytes=1 << 20,
        extra=["--dtype", "float32", "--namespace", "mine"],
    )  # fmt: skip
    lanes, duties = ["long", ""], ["decode"]
    roles = cmd.worker_roles("conditional", 2, 2)
    assert roles == [("prefill", 0), ("prefill", 1), ("mixed", 0), ("mixed", 1)]
    options = [
        parse(WorkerRole(role), [*common, *cmd.role_args(role, i, lanes, duties)])
        for role, i in roles
    ]
    first = options[0]
    assert (first.model, first.kvstore, first.backend) == (Path("/m"), "kv:1", "torch")
    assert (first.host_lease, first.kv_cache_bytes) == (Path("/lease"), 1 << 20)
    assert (first.dtype, first.namespace) == ("float32", "mine")  # the caller's flags win
    assert [o.role for o in options] == [WorkerRole.PREFILL] * 2 + [WorkerRole.MIXED] * 2
    assert [o.scheduling.lane for o in options] == ["long", "any", "any", "any"]
    assert [o.scheduling.duty for o in options] == ["", "", "decode", ""]
    bare = cmd.worker_args(
        Path("/m"), "ns", "kv:1", "sim", host_lease=None, kv_cache_bytes=None, extra=()
    )
    assert "--host-lease" not in bare and "--kv-cache-bytes" not in bare
    assert cmd.worker_roles("disaggregated", 1, 1) == [("prefill", 0), ("decode", 0)]
    assert cmd.worker_roles("colocated", 3, 1) == [("mixed", 0)]


def test_the_pools_are_sized_unless_the_caller_sized_them() -> None:
    for sized in (["--kv-blocks", "8"], ["--kv-cache-bytes=9"]):
        assert cmd.kv_budget(sized, "torch", 2, 0.5) is None
    assert cmd.kv_budget([], "tensorrt-llm", 2, 0.5) is None


def test_replica_names() -> None:
    assert [replica_name("router", i) for i in range(3)] == ["router", "router-1", "router-2"]
    assert is_replica("router-2", "router") and is_replica("router", "router")
    assert not is_replica("router-x", "router") and not is_replica("routers", "router")


def test_security_flags_of_a_secured_cluster(tmp_path: Path) -> None:
    assert cmd.security_args(None, client_auth=True) == []
    certs = make_certs(tmp_path / "tls")
    internal = cmd.security_args(certs, client_auth=True)
    assert internal[-1] == "--tls-client-auth" and str(certs.token) in internal
    assert "--tls-client-auth" not in cmd.security_args(certs, client_auth=False)
    gateway = cmd.gateway_security_args(certs, True)
    assert "--internal-token-file" not in gateway  # the gateway is a client, not a member
    assert gateway[gateway.index("--router-tls-cert") + 1] == str(certs.client_cert)
    assert "--router-tls-cert" not in cmd.gateway_security_args(certs, False)
