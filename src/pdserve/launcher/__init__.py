"""A whole pdserve cluster on one machine: what ``pdserve up`` (``pdserve.up``) and the tests run.

``Cluster.start()`` brings the services up in dependency order, each a child process on a free
port (``--port 0 --port-file F``)::

    Redis (embedded, unless a URL is given)
      -> KVStore, Scheduler
      -> N prefill + M decode workers (colocated: M mixed workers; conditional: N prefill +
         M mixed workers, the scheduler choosing per request), Router
      -> the HTTP gateway (when ``http_port`` is set)

and returns once every service's health check says SERVING (the gateway's ``/health``: 200)
and every worker's heartbeat is in Redis. ``stop()`` stops them in reverse order: SIGTERM, a
grace period, then SIGKILL. Children also get ``PR_SET_PDEATHSIG``, so none outlives a
launcher that is killed outright.

Security (``docs/security.md``): by default everything is plaintext and open on 127.0.0.1, the
insecure local mode. ``tls_dir`` runs the cluster secured with the certificates and internal
token of ``pdserve certs`` in that directory (made if missing): TLS on every port, mutual TLS
and the internal token between services, an embedded Redis with a password (its URL reaches
the services through ``PDSERVE_REDIS_URL``, never a command line), and the HTTP gateway
serves HTTPS with the cluster's certificate and calls the router over TLS; ``api_keys`` makes
the router demand API keys (the gateway forwards each HTTP caller's) and the scheduler apply
the tenants' quotas.

With ``supervise`` a ``supervisor.Supervisor`` restarts a service (or the embedded Redis) that
dies, on its port, while the rest serve on (``pdserve up`` supervises).

Telemetry: every service serves Prometheus ``/metrics`` on its own port (``metrics_urls()``;
free ports unless ``metrics_base_port`` is given) and traces into the OTLP collector at
``otlp_endpoint`` and/or the shared span file ``trace_file`` (``pdserve trace report
--span-file``); with neither, and no ``OTEL_*`` variables, nothing is traced.

The modules: ``cluster`` (``Cluster``: its settings and the services' lifecycle), ``args``
(each service's command line; the workers' flags come from ``WorkerOptions``' declarations)
and ``readiness`` (waiting for port files, health checks and heartbeats).
"""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.launcher.args import KV_STORES, MODES, is_replica, replica_name
from pdserve.launcher.cluster import Cluster
from pdserve.launcher.readiness import read_heartbeats
from pdserve.launcher.spec import ClusterSpec

__all__ = [
    "DEFAULT_MODEL_ROOT", "KV_STORES", "MODES", "Cluster", "ClusterSpec", "default_model",
    "is_replica",
    "read_heartbeats", "replica_name",
]  # fmt: skip

DEFAULT_MODEL_ROOT = Path.home() / ".cache" / "pdserve" / "models"


def default_model(preset: str) -> Path:
    """The demo checkpoint of ``preset`` under ~/.cache/pdserve/models, made on first use."""
    path = DEFAULT_MODEL_ROOT / f"demo-{preset}"
    if not (path / "config.json").is_file():
        from pdserve.models.demo import init_checkpoint  # imports torch: only when needed

        print(f"creating the {preset} demo checkpoint in {path} (first run only)", flush=True)
        tmp = path.with_name(path.name + ".partial")
        init_checkpoint(tmp, preset)
        os.replace(tmp, path)
    return path
