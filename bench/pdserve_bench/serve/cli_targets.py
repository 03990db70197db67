"""The targets of ``pdserve bench serve`` on its command line: routers, OpenAI-compatible
servers and the clusters it starts (``--config``), each with the options given after it.

A cluster runs on the torch backend or on the sim backend (``--backend``, or
``--target-backend`` after its ``--config``); sim clusters model accelerators
(``--sim-profile``, ``--sim-link``) and may run slowed down (``--sim-time-scale``), the
benchmark then working in modelled time (``timescale``)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.backends import SIM, TORCH
from pdserve.errors import InvalidArgumentError
from pdserve.sim.flags import DEFAULT_LINK as DEFAULT_SIM_LINK
from pdserve.sim.flags import DEFAULT_PROFILE as DEFAULT_SIM_PROFILE
from pdserve.sim.flags import sim_flags
from pdserve_bench.serve.features import FEATURES, get_features
from pdserve_bench.serve.openai import OpenAITarget
from pdserve_bench.serve.targets import ClusterSpec, RouterTarget, Target
from pdserve_bench.serve.timescale import FLAG as TIME_SCALE_FLAG
from pdserve_bench.serve.timescale import TimeScale

Log = Callable[[str], None]

BACKENDS = (TORCH, SIM)
"""The backends of the clusters the benchmark starts."""


@dataclass(slots=True)
class TargetArg:
    """One target named on the command line, in the order given."""

    kind: str
    """``router``, ``config`` or ``openai_url``."""
    value: str
    label: str | None = None
    scheduler_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    workers: tuple[int, int] | None = None
    """``--workers P:D`` of this cluster (else ``--prefill``/``--decode``)."""
    duties: list[str] = field(default_factory=list)
    lanes: list[str] = field(default_factory=list)
    planner_args: list[str] | None = None
    backend: str | None = None
    """``--target-backend`` of this cluster (else ``--backend``)."""
    features: str = "plain"
    """``--features`` of this target: what its requests carry (``features``)."""


class _AddTarget(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        ns.targets = [*(ns.targets or []), TargetArg(self.dest, str(values))]


class _Label(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        if not ns.targets:
            parser.error("--label names the target given before it: put it after one")
        if ns.targets[-1].label is not None:
            parser.error(f"{ns.targets[-1].value} has two labels")
        ns.targets[-1].label = str(values)


class _Features(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        if not ns.targets:
            parser.error("--features applies to the target given before it: put it after one")
        ns.targets[-1].features = str(values)


class _ClusterOption(argparse.Action):
    """An option of the ``--config`` cluster given just before it."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        if not ns.targets or ns.targets[-1].kind != "config":
            parser.error(f"{option_string} applies to the --config given before it: put it after")
        target = ns.targets[-1]
        if self.dest == "workers":
            p, sep, d = str(values).partition(":")
            if not (sep and p.isdigit() and d.isdigit() and int(d) >= 1):
                parser.error(f"--workers expects PREFILL:DECODE, e.g. 1:2, got {values!r}")
            target.workers = (int(p), int(d))
        elif self.dest == "duties":
            duties = str(values).split(",")
            if any(d not in ("prefill", "decode", "any") for d in duties):
                parser.error(f"--duties expects prefill, decode or any per worker, got {values!r}")
            target.duties = ["" if d == "any" else d for d in duties]
        elif self.dest == "lanes":
            lanes = str(values).split(",")
            if any(lane not in ("long", "short", "any") for lane in lanes):
                parser.error(f"--lanes expects long, short or any per worker, got {values!r}")
            target.lanes = ["" if lane == "any" else lane for lane in lanes]
        elif self.dest == "backend":
            target.backend = str(values)
        elif self.dest == "planner_args":
            target.planner_args = [
                *(target.planner_args or []),
                *([] if values is None else [str(values)]),
            ]
        else:
            getattr(target, self.dest).append(str(values))


def add_target_args(p: argparse.ArgumentParser) -> None:
    """The target, cluster and per-cluster options."""
    t = p.add_argument_group("targets (one or more, measured in the order given)")
    t.add_argument("--router", action=_AddTarget, metavar="HOST:PORT", help="a running router")
    t.add_argument(
        "--config",
        action=_AddTarget,
        choices=["disaggregated", "colocated", "conditional"],
        help="start a local pdserve cluster of this kind (conditional: prefill + mixed "
        "workers, the scheduler choosing per request)",
    )
    t.add_argument(
        "--openai-url",
        action=_AddTarget,
        metavar="URL",
        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000",
    )
    t.add_argument("--label", action=_Label, help="name of the target given just before")
    t.add_argument(
        "--features", action=_Features, choices=sorted(FEATURES),
        help="what the requests of the target given just before carry beyond a plain greedy "
        "completion (json-schema: response_format json_schema; penalties: presence, frequency "
        "and repetition penalties and min_tokens); default plain",
    )  # fmt: skip
    t.add_argument("--openai-model", help="model name to send (default: ask GET /v1/models)")
    c = p.add_argument_group("clusters started with --config")
    c.add_argument("--model", type=Path, help="checkpoint dir (default: the --preset demo model)")
    c.add_argument("--preset", default="small", choices=["tiny", "small", "base"])
    c.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    c.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    c.add_argument(
        "--colocated-workers",
        type=int,
        help="mixed workers when colocated (default: prefill + decode)",
    )
    c.add_argument("--threads", type=int, help="torch threads per worker of torch clusters")
    c.add_argument("--backend", default=TORCH, choices=BACKENDS,
                   help="the clusters' engine: torch, or sim (modelled accelerators, see "
                   "docs/simulation.md; default: %(default)s)")  # fmt: skip
    c.add_argument("--sim-profile", default=DEFAULT_SIM_PROFILE, metavar="SPEC",
                   help="sim clusters' timing model, roofline:ACCEL:MODEL[:tpN] or "
                   "fitted:FILE (default: %(default)s)")  # fmt: skip
    c.add_argument(
        "--sim-time-scale", type=float, default=1.0, metavar="K",
        help="sim clusters' workers make every modelled second last K real ones; rates, SLOs, "
        "--request-timeout and the report are then in modelled time (default: 1)",
    )  # fmt: skip
    c.add_argument("--sim-link", default=DEFAULT_SIM_LINK, metavar="NAME",
                   help="sim clusters' modelled hand-off link (nvlink, rdma-400, rdma-200, "
                   "tcp-25, same-host; default: %(default)s)")  # fmt: skip
    c.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"])
    c.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra worker flag, repeatable: --worker-arg=--max-num-seqs=64",
    )
    c.add_argument("--log-dir", type=Path, help="keep the clusters' logs here")
    o = p.add_argument_group("options of the --config cluster given just before them")
    o.add_argument("--workers", action=_ClusterOption, metavar="P:D",
                   help="this cluster's prefill and decode (or mixed) workers")  # fmt: skip
    o.add_argument(
        "--scheduler-arg",
        dest="scheduler_args",
        action=_ClusterOption,
        metavar="FLAG",
        help="extra scheduler flag (--scheduler-arg=--ttft-slo=3)",
    )
    o.add_argument("--router-arg", dest="router_args", action=_ClusterOption, metavar="FLAG",
                   help="extra router flag")  # fmt: skip
    o.add_argument("--target-worker-arg", dest="worker_args", action=_ClusterOption,
                   metavar="FLAG", help="extra flag for this cluster's workers only")  # fmt: skip
    o.add_argument("--target-backend", dest="backend", action=_ClusterOption, choices=BACKENDS,
                   help="this cluster's backend, instead of --backend")  # fmt: skip
    o.add_argument("--duties", action=_ClusterOption, metavar="D,D,...",
                   help="initial duty of each mixed worker: prefill, decode or any")  # fmt: skip
    o.add_argument("--lanes", action=_ClusterOption, metavar="L,L,...",
                   help="lane of each prefill worker: long, short or any")  # fmt: skip
    o.add_argument(
        "--planner",
        dest="planner_args",
        action=_ClusterOption,
        nargs="?",
        const=None,
        metavar="FLAG",
        help="start the P:D planner; a value is a planner flag (repeatable)",
    )


def make_targets(args: argparse.Namespace, stack: contextlib.ExitStack, log: Log) -> list[Target]:
    """The targets in command-line order; clusters are started here and stopped by ``stack``."""
    from pdserve.launcher import Cluster

    targets: list[Target] = []
    for arg, label in zip(args.targets, labels(args), strict=True):
        features = get_features(arg.features)
        if arg.kind == "router":
            targets.append(RouterTarget(arg.value, label, features=features))
        elif arg.kind == "openai_url":
            targets.append(
                OpenAITarget(arg.value, label, model=args.openai_model, features=features)
            )
        else:
            spec = cluster_spec(args, arg.value, arg)
            log(f"starting {label} ...")
            cluster = Cluster(
                spec.model, num_prefill=spec.prefill, num_decode=spec.decode, mode=spec.mode,
                worker_args=spec.worker_args, backend=spec.backend, startup_timeout_s=600.0,
                scheduler_args=spec.scheduler_args, router_args=spec.router_args,
                duties=spec.duties, lanes=spec.lanes, planner=spec.planner_args is not None,
                planner_args=spec.planner_args or (),
                log_dir=args.log_dir / label if args.log_dir is not None else None,
            )  # fmt: skip
            stack.enter_context(cluster)
            log(f"{label}: router at {cluster.router_address}")
            targets.append(RouterTarget(cluster.router_address, label, cluster=cluster,
                                        spec=spec, features=features))  # fmt: skip
    return targets


def labels(args: argparse.Namespace) -> list[str]:
    """Each target's label: given with ``--label``, else made from what it is."""
    out = []
    for arg in args.targets:
        if arg.label is not None:
            out.append(arg.label)
            continue
        if arg.kind == "router":
            label = f"router-{arg.value}"
        elif arg.kind == "openai_url":
            label = "openai-" + arg.value.split("//", 1)[-1].split("/", 1)[0]
        else:
            label = cluster_spec(args, arg.value, arg).default_label
        out.append(label if arg.features == "plain" else f"{label}+{arg.features}")
    return out


def cluster_spec(
    args: argparse.Namespace, mode: str, target: TargetArg | None = None
) -> ClusterSpec:
    """The cluster ``--config mode`` asks for (the demo model is made on first use), with the
    options given after it (``target``)."""
    from pdserve.launcher import default_model

    prefill, decode = target.workers if target and target.workers else (args.prefill, args.decode)
    backend = backend_of(args, target)
    extra = ["--dtype", args.dtype]
    if backend == SIM:
        extra += sim_worker_args(args)  # nothing computes: no --threads
    elif args.threads:
        extra += ["--threads", str(args.threads)]
    model = args.model or default_model(args.preset)
    if mode == "colocated" and not (target and target.workers):
        decode = args.colocated_workers or prefill + decode
    own = target or TargetArg("config", mode)
    return ClusterSpec(
        mode, model, prefill, decode, (*extra, *args.worker_arg, *own.worker_args),
        tuple(own.scheduler_args), tuple(own.router_args), tuple(own.duties),
        None if own.planner_args is None else tuple(own.planner_args), tuple(own.lanes),
        backend,
    )  # fmt: skip


def backend_of(args: argparse.Namespace, target: TargetArg | None) -> str:
    """A cluster's backend: its ``--target-backend``, else ``--backend``."""
    return target.backend if target is not None and target.backend else str(args.backend)


def sim_worker_args(args: argparse.Namespace) -> list[str]:
    """The sim flags of a sim cluster's workers, checked first (``InvalidArgumentError``
    names the flag) so that a bad one stops the benchmark before anything starts."""
    from pdserve.sim.backend import SimOptions  # loads torch: only for sim clusters

    SimOptions.parse(args.sim_profile, args.sim_time_scale, args.sim_link)
    return sim_flags(args.sim_profile, args.sim_time_scale, args.sim_link)


def time_scale_of(args: argparse.Namespace) -> TimeScale:
    """The run's time scale: ``--sim-time-scale`` when the clusters started are sim ones.

    Refused: a scale other than 1 with no sim cluster to apply it to, or beside a target in
    real time (a torch cluster, a router, an OpenAI-compatible server), whose rates and
    latencies would be in other units than the sim clusters'."""
    scale = TimeScale(float(args.sim_time_scale))  # > 0, or refused naming the flag
    if scale.is_real:
        return scale
    sims = [t for t in args.targets if t.kind == "config" and backend_of(args, t) == SIM]
    if not sims:
        raise InvalidArgumentError(
            TIME_SCALE_FLAG, "applies to sim clusters (--backend sim or --target-backend sim), "
            "and this run starts none",
        )  # fmt: skip
    real = [
        label for t, label in zip(args.targets, labels(args), strict=True)
        if t.kind != "config" or backend_of(args, t) != SIM
    ]  # fmt: skip
    if real:
        raise InvalidArgumentError(
            TIME_SCALE_FLAG, f"{scale.factor:g} puts the sim clusters in modelled time, but "
            f"{', '.join(real)} run in real time: the rates and latencies would not compare "
            "(measure them in separate runs, or with --sim-time-scale 1)",
        )  # fmt: skip
    return scale
