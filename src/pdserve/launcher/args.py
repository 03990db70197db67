"""The command lines a ``Cluster`` starts its services with, which workers it runs, and the
names of service replicas.

The workers' flags come from the declarations of ``WorkerOptions`` (``settings.flags_for``),
so a renamed or re-typed worker setting changes here too; the security flags from the
cluster's certificates (``security.certs``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdserve import hostmem
from pdserve.backends import TORCH
from pdserve.engine.config import EngineConfig
from pdserve.security.certs import ClusterCerts
from pdserve.settings import flag_names, flags_for
from pdserve.worker.options import WorkerOptions

MODES = ("disaggregated", "colocated", "conditional")
"""Cluster kinds: prefill + decode workers, mixed workers only, or prefill + mixed workers."""
KV_STORES = ("embedded", "mooncake")
"""The cluster's KV store: pdserve's KV store service, or a Mooncake Store whose
``mooncake_master`` the cluster starts (the workers lend it their segments)."""


def replica_name(service: str, i: int) -> str:
    """The name of replica ``i`` of a service: the first keeps the plain name."""
    return service if i == 0 else f"{service}-{i}"


def is_replica(name: str, service: str) -> bool:
    """Whether ``name`` is one of ``service``'s replicas (``replica_name``)."""
    return name == service or (
        name.startswith(f"{service}-") and name.removeprefix(f"{service}-").isdigit()
    )


def security_args(certs: ClusterCerts | None, *, client_auth: bool) -> list[str]:
    """Security flags of a service: the cluster's certificate, CA, mutual TLS (``client_auth``:
    internal services; the router with ``router_client_auth``) and the token file."""
    if certs is None:
        return []
    args = ["--tls-cert", str(certs.node_cert), "--tls-key", str(certs.node_key),
            "--tls-ca", str(certs.ca), "--internal-token-file", str(certs.token)]  # fmt: skip
    return [*args, "--tls-client-auth"] if client_auth else args


def gateway_security_args(certs: ClusterCerts | None, router_client_auth: bool) -> list[str]:
    """HTTPS with the cluster's certificate, TLS to the router, and the client certificate
    (not a member's) when the router demands one. No internal token: the gateway is a client,
    which sends each HTTP caller's API key."""
    if certs is None:
        return []
    args = ["--tls-cert", str(certs.node_cert), "--tls-key", str(certs.node_key),
            "--router-tls-ca", str(certs.ca)]  # fmt: skip
    if router_client_auth:
        args += ["--router-tls-cert", str(certs.client_cert),
                 "--router-tls-key", str(certs.client_key)]  # fmt: skip
    return args


def kv_budget(
    worker_args: Sequence[str], backend: str, workers: int, fraction: float
) -> int | None:
    """Each worker's ``--kv-cache-bytes``: its share of ``fraction`` of this host's available
    memory (``hostmem.kv_share``); None when the worker args size the pools, the backend is
    not ours, or memory is unknown."""
    sizing = {*flag_names(WorkerOptions, "kv_blocks"), *flag_names(WorkerOptions, "kv_cache_bytes")}
    available = hostmem.available_bytes()
    if any(a.split("=")[0] in sizing for a in worker_args) or backend != TORCH or available is None:
        return None
    return hostmem.kv_share(available, workers, fraction, EngineConfig().kv_cache_bytes)


def worker_args(
    model: Path, namespace: str, kvstore: str, backend: str, *, host_lease: Path | None,
    kv_cache_bytes: int | None, extra: Sequence[str],
) -> list[str]:  # fmt: skip
    """The flags every worker of the cluster gets, then ``extra`` (the caller's, which win)."""
    return [
        *flags_for(WorkerOptions, model=model, namespace=namespace, kvstore=kvstore,
                   backend=backend, host_lease=host_lease, kv_cache_bytes=kv_cache_bytes),
        *extra,
    ]  # fmt: skip


def role_args(role: str, i: int, lanes: Sequence[str], duties: Sequence[str]) -> list[str]:
    """The flags of worker ``i`` of ``role``: a prefill worker's lane, a mixed worker's role
    and initial duty (``lanes``, ``duties``: one per worker, in order; missing: any)."""
    if role == "prefill":
        return flags_for(WorkerOptions, lane=lanes[i] if i < len(lanes) and lanes[i] else None)
    if role != "mixed":
        return []
    duty = duties[i] if i < len(duties) and duties[i] else None
    return flags_for(WorkerOptions, role="mixed", duty=duty)


def worker_roles(mode: str, num_prefill: int, num_decode: int) -> list[tuple[str, int]]:
    """(role, index) of each worker ``mode`` runs: prefill ones (none when colocated), then
    decode ones (disaggregated) or mixed ones."""
    prefills = [] if mode == "colocated" else [("prefill", i) for i in range(num_prefill)]
    second = "decode" if mode == "disaggregated" else "mixed"
    return prefills + [(second, i) for i in range(num_decode)]
