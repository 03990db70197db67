"""How the OpenMP threads of a worker's engine wait when idle: one policy for every process
that runs an engine or measures one.

Several engines share a host's cores. OpenMP threads that spin while idle would take the
cores from the engine that is busy, so every service of a cluster starts with idle threads
that sleep (``OMP_WAIT_POLICY=PASSIVE``). Sleeping threads are woken at every parallel
region, which makes each step of a small model slower than with spinning threads: anything
that measures a worker's step times (``pdserve sim calibrate``) must measure under the same
policy, or it fits steps the workers never take.

libgomp reads the variable once, when torch first loads it, so it is set before that.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
WORKER_WAIT_POLICY = "PASSIVE"


def worker_omp_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with the workers' wait policy where it names
    none: the environment a service process starts with."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault(OMP_WAIT_POLICY, WORKER_WAIT_POLICY)
    return env


def adopt_worker_wait_policy() -> str:
    """Give this process the workers' wait policy unless its environment names one; returns
    the policy in effect. Call before torch loads: after, a changed variable is not read."""
    os.environ.setdefault(OMP_WAIT_POLICY, WORKER_WAIT_POLICY)
    return os.environ[OMP_WAIT_POLICY]
