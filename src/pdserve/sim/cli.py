"""``pdserve sim``: tools for the simulated-accelerator backend.

``pdserve sim calibrate --model DIR --out FILE`` measures the torch engine's step times on
this machine (``pdserve.sim.calibrate``) and writes a fitted profile that
``--backend sim --sim-profile fitted:FILE`` replays.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from pdserve.errors import InvalidArgumentError
from pdserve.sim.timing import Fitted


def sim_parser() -> argparse.ArgumentParser:
    """The parser of ``pdserve sim ...``: one subparser per tool (``calibrate`` so far)."""
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
    cal.add_argument("--quick", action="store_true", help="a few small shapes (a smoke run)")
    cal.add_argument("--repeats", type=int, default=None, help="steps measured per shape")
    return parser


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
    print(f"fitted {fitted.samples} steps:")
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
    import torch

    from pdserve.engine.dtype import resolve_dtype
    from pdserve.models.linear import cpu_has_bf16_kernels
    from pdserve.sim.calibrate import CalibrationPlan, calibrate, cpu_model, isa_flags

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
    fitted = calibrate(
        args.model,
        plan,
        dtype=args.dtype,
        threads=args.threads,
        progress=lambda line: print(f"  {line}", flush=True),
    )
    _print_fit(fitted)
    fitted.save(args.out)
    print(f"wrote {args.out}")
    print(f"use it with: --backend sim --sim-profile fitted:{args.out}")
    return 0


def main_sim(argv: Sequence[str]) -> int:
    """Entry of ``pdserve sim``: ``argv`` is what follows ``sim`` on the command line."""
    args = sim_parser().parse_args(list(argv))
    if args.sim_command == "calibrate":
        return run_calibrate(args)
    raise AssertionError(f"unhandled sim command {args.sim_command!r}")  # argparse forbids it
