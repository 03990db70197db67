"""``pdserve sim``: tools for the simulated-accelerator backend.

``pdserve sim calibrate --model DIR --out FILE`` measures the torch engine's step times on
this machine (``pdserve.sim.calibrate``) and writes a fitted profile that
``--backend sim --sim-profile fitted:FILE`` replays.

``pdserve sim plan --trace FILE --ttft-slo S --itl-slo S`` replays a captured trace against
sim clusters of growing size and every P:D split, and names the smallest that would have
held the SLO (``pdserve.sim.plan``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.compute.omp import adopt_worker_wait_policy
from pdserve.errors import InvalidArgumentError
from pdserve.sim.fitted import Fitted


def sim_parser() -> argparse.ArgumentParser:
    """The parser of ``pdserve sim ...``: one subparser per tool (``calibrate``, ``plan``)."""
    parser = argparse.ArgumentParser(
        prog="pdserve sim", description="tools for simulated accelerators (--backend sim)"
    )
    sub = parser.add_subparsers(dest="sim_command", required=True, metavar="COMMAND")
    cal = sub.add_parser(
        "calibrate",
        help="measure this machine's engine step times and fit a profile",
        description="Run the torch engine on a checkpoint through a plan of prefill and "
        "decode shapes, time every step, and fit the linear step-time model that "
        "'--backend sim --sim-profile fitted:FILE' uses.",
    )
    cal.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    cal.add_argument("--out", type=Path, required=True, help="profile JSON file to write")
    cal.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="compute dtype (auto: bfloat16 where the CPU has bf16 kernels, else float32)",
    )
    cal.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    cal.add_argument(
        "--no-split",
        dest="split",
        action="store_false",
        help="measure on every thread only, not also on the shares of a host lease's split "
        "(sim workers sharing a --host-lease then take turns instead of splitting)",
    )
    cal.add_argument(
        "--steps",
        type=Path,
        action="append",
        metavar="FILE",
        help="fit to the steps serving workers recorded (their --record-steps files; "
        "repeatable) instead of measuring a plan: the steps under the cluster's own load",
    )
    cal.add_argument("--quick", action="store_true", help="a few small shapes (a smoke run)")
    cal.add_argument("--repeats", type=int, default=None, help="steps measured per shape")
    _add_plan_parser(sub)
    return parser


def _seconds(text: str) -> float:
    """A time like ``2``, ``2s`` or ``150ms``, in seconds."""
    unit = 1e-3 if text.endswith("ms") else 1.0
    number = text.removesuffix("ms") if unit != 1.0 else text.removesuffix("s")
    try:
        value = float(number) * unit
    except ValueError:
        msg = f"expected a time like 2, 2s or 150ms, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive time, got {text!r}")
    return value


def _add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pdserve.sim.plan import DEFAULT_LINK, DEFAULT_PROFILE, MODES

    plan = sub.add_parser(
        "plan",
        help="the smallest sim cluster and P:D split that holds an SLO for a trace",
        description="Replay a trace (pdserve trace capture, or any bench serve --trace file) "
        "at its own arrival times against sim clusters, smallest first: for each total of "
        "workers, every prefill:decode split (and all-mixed colocated), stopping at the first "
        "total where a configuration's goodput reaches the target. Prints every "
        "configuration tried and the one chosen; exit status 1 when none up to "
        "--max-workers did. Each configuration is one 'pdserve bench serve' run.",
    )
    plan.add_argument("--trace", type=Path, required=True, help="JSONL trace to replay")
    plan.add_argument(
        "--ttft-slo",
        type=_seconds,
        required=True,
        metavar="S",
        help="time to first token bound (seconds, or 150ms)",
    )
    plan.add_argument(
        "--itl-slo",
        type=_seconds,
        required=True,
        metavar="S",
        help="bound on a request's p99 inter-token gap (seconds, or 50ms)",
    )
    plan.add_argument(
        "--goodput",
        type=float,
        default=0.9,
        help="share of requests within both SLOs to reach (default 0.9)",
    )
    plan.add_argument("--max-workers", type=int, default=8, help="largest total (default 8)")
    plan.add_argument("--min-workers", type=int, default=2, help="smallest total (default 2)")
    plan.add_argument(
        "--mode",
        action="extend",
        nargs="+",
        choices=MODES,
        help="cluster kinds to try, in this order (default: all three)",
    )
    plan.add_argument(
        "--profile",
        "--sim-profile",
        dest="profile",
        default=DEFAULT_PROFILE,
        metavar="SPEC",
        help="timing model (default: %(default)s)",
    )
    plan.add_argument(
        "--sim-time-scale",
        type=float,
        default=1.0,
        metavar="K",
        help="real seconds per modelled second; SLOs stay modelled (default 1)",
    )
    plan.add_argument(
        "--sim-link",
        default=DEFAULT_LINK,
        metavar="NAME",
        help="modelled hand-off link (default: %(default)s)",
    )
    plan.add_argument("--model", type=Path, help="checkpoint dir for the served vocabulary")
    plan.add_argument(
        "--preset",
        default="small",
        choices=["tiny", "small", "base"],
        help="demo model when no --model (default: %(default)s)",
    )
    plan.add_argument("--vocab-size", type=int, help="token ids from [16, this)")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--request-timeout", type=_seconds, default=300.0, metavar="S")
    plan.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra worker flag, repeatable: --worker-arg=--max-num-seqs=64",
    )
    plan.add_argument("--log-dir", type=Path, help="keep each run's output and logs here")
    plan.add_argument("--json", type=Path, help="write the plan (every configuration) here")


def _check_args(args: argparse.Namespace) -> None:
    """Refuse what would fail late (after minutes of measuring) or with a traceback."""
    model: Path = args.model
    if not model.is_dir():
        raise InvalidArgumentError("--model", f"{model} is not a directory")
    if not (model / "config.json").is_file():
        raise InvalidArgumentError("--model", f"{model} has no config.json: not a checkpoint")
    out: Path = args.out
    if out.is_dir():
        raise InvalidArgumentError("--out", f"{out} is a directory; name a file")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InvalidArgumentError("--out", f"directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InvalidArgumentError("--out", f"directory {parent} is not writable")
    if args.threads is not None and args.threads < 1:
        raise InvalidArgumentError("--threads", f"must be >= 1, got {args.threads}")
    if args.repeats is not None and args.repeats < 1:
        raise InvalidArgumentError("--repeats", f"must be >= 1, got {args.repeats}")


def _print_fit(fitted: Fitted) -> None:
    """The coefficients with a readable unit each, and how well the model fits."""
    rows = (
        ("overhead_s", fitted.overhead_s, 1e3, "ms per step"),
        ("prefill_token_s", fitted.prefill_token_s, 1e6, "us per prompt token"),
        ("decode_seq_s", fitted.decode_seq_s, 1e6, "us per decoding sequence"),
        ("attention_pair_s", fitted.attention_pair_s, 1e9, "ns per (query, key) pair"),
        ("kv_read_token_s", fitted.kv_read_token_s, 1e9, "ns per cached KV token read"),
    )
    print(f"fitted {fitted.samples} steps on {fitted.threads} threads:")
    for name, value, scale, unit in rows:
        print(f"  {name:<17} {value:.4e} s  ({value * scale:.4g} {unit})")
    print(f"  median relative error {fitted.rel_error:.1%}")


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not on this platform
        return None


def run_calibrate(args: argparse.Namespace) -> int:
    """Carry out a parsed ``sim calibrate``; returns the exit status."""
    # Before torch loads: the workers' steps are measured, and their idle threads sleep.
    policy = adopt_worker_wait_policy()
    import torch

    from pdserve.cpuinfo import cpu_model, isa_flags
    from pdserve.engine.dtype import resolve_dtype
    from pdserve.models.linear import cpu_has_bf16_kernels
    from pdserve.sim.calibrate import calibrate, fit_recorded
    from pdserve.sim.companion import beside
    from pdserve.sim.recording import CalibrationPlan, read_step_logs
    from pdserve.sim.shapes import ModelShape

    _check_args(args)
    plan = CalibrationPlan.quick() if args.quick else CalibrationPlan()
    if args.repeats is not None:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    threads = args.threads or torch.get_num_threads()
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs")
    print(
        f"isa: {' '.join(isa_flags()) or 'no avx2'} "
        f"(oneDNN bf16 kernels: {'yes' if cpu_has_bf16_kernels() else 'no'})"
    )
    load = _load_average()
    if load is not None and load > (os.cpu_count() or 1):
        print(f"warning: 1-minute load {load:.1f}: other work will inflate the measured steps")
    dtype = resolve_dtype(args.dtype, "cpu")
    print(f"torch {torch.__version__}, {threads} threads, dtype {dtype} (--dtype {args.dtype})")
    print(f"OpenMP wait policy {policy}, as the workers run (compute.omp)")
    if args.steps:  # the steps as serving workers took them, under their load
        shape = ModelShape.from_config(args.model / "config.json", flag="--model")
        shape = dataclasses.replace(shape, dtype_bytes=getattr(torch, dtype).itemsize)
        fitted = fit_recorded(read_step_logs(args.steps), shape, dtype)
        print(f"fitted to the steps recorded in {', '.join(str(p) for p in args.steps)}")
    else:
        fitted = calibrate(
            args.model,
            plan,
            dtype=args.dtype,
            threads=args.threads,
            split=args.split,
            beside=functools.partial(beside, args.model, dtype=args.dtype),
            progress=lambda line: print(f"  {line}", flush=True),
        )
    for each in (fitted, *fitted.shares):
        _print_fit(each)
    fitted.save(args.out)
    print(f"wrote {args.out}")
    print(f"use it with: --backend sim --sim-profile fitted:{args.out}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """Carry out a parsed ``sim plan``: 0 when a configuration met the target, 1 when none
    did. Everything that can be refused is refused before the first cluster starts."""
    from pdserve.sim.backend import SimOptions
    from pdserve.sim.plan import MODES, BenchRun, check_search, format_plan, outcome_line, plan
    from pdserve.trace_file import load_trace, trace_rate

    modes = tuple(dict.fromkeys(args.mode or MODES))
    check_search(goal=args.goodput, max_workers=args.max_workers,
                 min_workers=args.min_workers, modes=modes)  # fmt: skip
    trace = load_trace(args.trace)
    SimOptions.parse(args.profile, args.sim_time_scale, args.sim_link)  # names the bad flag
    for flag, path in (("--json", args.json), ("--log-dir", args.log_dir)):
        if path is not None and not path.resolve().parent.is_dir():
            raise InvalidArgumentError(flag, f"{path}: its folder does not exist")
    if args.vocab_size is not None and args.vocab_size <= 16:
        raise InvalidArgumentError("--vocab-size", f"must exceed 16, got {args.vocab_size}")
    if args.model is not None and not (args.model / "config.json").is_file():
        raise InvalidArgumentError("--model", f"{args.model} has no config.json")
    run = BenchRun(
        args.trace.resolve(), args.ttft_slo, args.itl_slo, args.goodput, args.profile,
        args.sim_time_scale, args.sim_link, args.model, args.preset, args.vocab_size,
        args.seed, args.request_timeout, tuple(args.worker_arg),
        None if args.log_dir is None else args.log_dir.resolve(),
    )  # fmt: skip
    rate = trace_rate(trace)
    span = trace[-1].arrival_s - trace[0].arrival_s
    print(
        f"pdserve sim plan: trace of {len(trace)} requests over {span:.3g} s"
        + (f" ({rate:.3g} req/s)" if rate is not None else "")
        + f"; SLO TTFT <= {args.ttft_slo:g} s, p99 ITL <= {args.itl_slo:g} s, "
        f"goodput >= {args.goodput:g}; {args.profile}, time scale {args.sim_time_scale:g}",
        flush=True,
    )
    result = plan(
        run.measure, goal=args.goodput, max_workers=args.max_workers,
        min_workers=args.min_workers, modes=modes,
        on_outcome=lambda o: print(f"  {outcome_line(o)}", file=sys.stderr, flush=True),
    )  # fmt: skip
    print(format_plan(result), end="")
    if args.json is not None:
        doc = {"trace": str(args.trace), "requests": len(trace),
               "slo": {"ttft_s": args.ttft_slo, "itl_s": args.itl_slo},
               "profile": args.profile, "time_scale": args.sim_time_scale,
               "link": args.sim_link, **result.to_json()}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if result.chosen is not None else 1


def main_sim(argv: Sequence[str]) -> int:
    """Entry of ``pdserve sim``: ``argv`` is what follows ``sim`` on the command line."""
    args = sim_parser().parse_args(list(argv))
    if args.sim_command == "calibrate":
        return run_calibrate(args)
    if args.sim_command == "plan":
        return run_plan(args)
    raise AssertionError(f"unhandled sim command {args.sim_command!r}")  # argparse forbids it
