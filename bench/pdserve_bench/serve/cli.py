"""``pdserve bench serve``: the command line; see ``pdserve_bench.serve`` for the method
(``cli_targets`` has the target options)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve.compute.omp import adopt_worker_wait_policy
from pdserve.errors import InvalidArgumentError, PdServeError
from pdserve_bench.serve.calibrate import ScaledSlo, measure, other_scales, scaled
from pdserve_bench.serve.cli_targets import (
    add_target_args,
    labels,
    make_targets,
)
from pdserve_bench.serve.mixes import MIXES
from pdserve_bench.serve.progress import ProgressBar
from pdserve_bench.serve.report import format_report, to_json
from pdserve_bench.serve.settings import DEFAULT_RATE, DEFAULT_REQUESTS, Settings, settings
from pdserve_bench.serve.sweep import RunResult, run_all
from pdserve_bench.serve.targets import Target

Log = Callable[[str], None]


def _duration(default_unit: str) -> Any:
    """A time like ``150ms``, ``3s`` or a bare number in ``default_unit``, as seconds."""

    def parse(text: str) -> float:
        scale = {"ms": 1e-3, "s": 1.0}
        unit = next((u for u in ("ms", "s") if text.endswith(u)), default_unit)
        number = text[: -len(unit)] if text.endswith(unit) else text
        try:
            return float(number) * scale[unit]
        except ValueError:
            msg = f"expected a time like 3s or 150ms, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None

    return parse


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"expected comma-separated numbers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _burst(text: str) -> int:
    if text == "all":
        return 0
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    mixes = "\n".join(f"  {m.name:<18} {m.summary()}" for m in MIXES.values())
    p = argparse.ArgumentParser(
        prog="pdserve bench serve",
        description="Open-loop serving benchmark: TTFT, ITL, TPOT, e2e, goodput and rejections "
        "against offered rate, for pdserve and any OpenAI-compatible server side by side.",
        epilog=f"mixes:\n{mixes}\n\nsee docs/benchmarks.md for the method and examples",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(targets=[])
    add_target_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--mix", default="long-prompt-heavy", choices=sorted(MIXES))
    w.add_argument("--trace", type=Path, help="JSONL trace instead of a mix (see docs)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--vocab-size",
        type=int,
        help="token ids are drawn from [16, this) (default: the model's vocabulary)",
    )
    w.add_argument(
        "--num-requests", type=int, help=f"measured per point (default {DEFAULT_REQUESTS})"
    )
    w.add_argument("--duration", type=_duration("s"), help="or: measure arrivals for this long")
    w.add_argument("--warmup", type=int, default=4, help="unmeasured requests first (default 4)")
    w.add_argument(
        "--burst",
        type=_burst,
        metavar="N|all",
        help="bursts of N every N/rate s, not Poisson; all: everything at t=0",
    )
    r = p.add_argument_group("rates and SLOs")
    r.add_argument(
        "--rates", type=_floats, help=f"offered req/s, e.g. 2,4,6,8 (default {DEFAULT_RATE:g})"
    )
    r.add_argument(
        "--search", action="store_true", help="find the highest rate meeting --goodput-target"
    )
    r.add_argument(
        "--search-range",
        type=_floats,
        metavar="LO,HI",
        help="bounds of the search (default: --rates' extremes, else 1,16)",
    )
    r.add_argument("--search-resolution", type=float, default=0.5, help="req/s (default 0.5)")
    r.add_argument("--goodput-target", type=float, default=0.9)
    r.add_argument("--ttft-slo", type=_duration("s"), default=3.0, help="default 3s")
    r.add_argument("--itl-slo", type=_duration("ms"), default=0.150, help="default 150ms")
    r.add_argument(
        "--slo-scale",
        type=_floats,
        metavar="K[,K2,...]",
        help="SLOs scaled to the machine instead of --ttft-slo/--itl-slo: K x the slowest "
        "target's isolated TTFT (the mix's longest prompts) and ITL p50, measured first; "
        "K2... add goodput under those scales",
    )
    r.add_argument("--request-timeout", type=_duration("s"), default=300.0, help="default 300s")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="every request record, summaries, config, machine")
    o.add_argument("--plot", type=Path, help="PNG of latency and goodput vs rate")
    o.add_argument("--html", type=Path, help="HTML page: the tables and the plot")
    o.add_argument("--quiet", action="store_true", help="no progress bar or log on stderr")
    o.add_argument(
        "--max-load",
        type=float,
        default=1.0,
        help="wait for a 1-minute load below this before starting (with --wait-minutes)",
    )
    o.add_argument("--wait-minutes", type=float, default=0.0)
    return p


def check_command_line(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What can be refused before anything starts: no target, two alike labels, an output
    file whose folder does not exist, a bad sim flag (``InvalidArgumentError``)."""
    if not args.targets:
        p.error("give a target: --router, --config or --openai-url")
    names = labels(args)
    if len(set(names)) != len(names):
        p.error(f"targets need different labels (--label), got {names}")
    for path in (args.json, args.plot, args.html):
        if path is not None and not path.resolve().parent.is_dir():
            p.error(f"{path}: its folder does not exist")


async def _run(targets: Sequence[Target], s: Settings, bar: ProgressBar, log: Log,
               load_average: Callable[[], float | None]
               ) -> tuple[RunResult, Settings, list[ScaledSlo]]:  # fmt: skip
    """The sweep, with the settings it ran under (the SLO scaled to the machine when asked)
    and the scaled SLOs."""
    opened: list[Target] = []
    try:
        for t in targets:
            await t.open()
            opened.append(t)
        found: list[ScaledSlo] = []
        if s.slo_scales:
            assert s.load.mix is not None  # settings() refuses --slo-scale without a mix
            log("measuring each target alone for the scaled SLOs ...")
            isolated = [
                await measure(t, s.load.mix, s.load.vocab_size, seed=s.load.seed,
                              scale=s.time_scale)
                for t in targets
            ]  # fmt: skip
            found = [scaled(k, isolated) for k in s.slo_scales]
            s = dataclasses.replace(s, slo=found[0].slo)
            for f in found:
                log(f.describe())
        result = await run_all(
            targets, s.load, rates=s.rates, search=s.search, slo=s.slo,
            request_timeout_s=s.request_timeout_s, time_scale=s.time_scale,
            load_average=load_average,
            on_progress=bar.update, log=log,
        )  # fmt: skip
        return result, s, found
    finally:
        bar.done()
        for t in opened:
            await t.close()


def main(argv: Sequence[str]) -> int:
    """Entry of ``pdserve bench serve``."""
    p = parser()
    args = p.parse_args(list(argv))

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    # Before torch loads: this process's idle OpenMP threads must not spin on the cores the
    # servers under test are using (the launcher sets the same for its children).
    adopt_worker_wait_policy()
    try:
        check_command_line(p, args)  # sim flags are checked here (the clusters' labels)
        s = settings(args)
    except (InvalidArgumentError, OSError) as e:
        p.error(str(e))
    from pdserve_bench.engine_bench import load_average, machine_info, wait_for_quiet

    wait_for_quiet(args.max_load, args.wait_minutes * 60.0, log)
    machine = {**machine_info(), "load_1min_start": load_average(),
               "usable_cpus": len(os.sched_getaffinity(0))}  # fmt: skip
    log(s.headline())
    try:
        with contextlib.ExitStack() as stack:
            targets = make_targets(args, stack, log)
            bar = ProgressBar(enabled=not args.quiet)
            result, s, found = asyncio.run(_run(targets, s, bar, log, load_average))
    except PdServeError as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 1
    machine["load_1min_end"] = load_average()
    headline = "\n".join([s.headline(), *(f.describe() for f in found[:1])])
    print(format_report(result, targets, slo=s.slo, headline=headline), end="")
    if found[1:]:
        print(
            "\n".join(["", "goodput under the other SLO scales:", *other_scales(result, found[1:])])
        )
    write_outputs(args, result, targets, s, machine, log, argv=["bench", "serve", *argv],
                  scaled_slos=found)  # fmt: skip
    return 0


def write_outputs(args: argparse.Namespace, result: RunResult, targets: Sequence[Target],
                  s: Settings, machine: dict[str, Any], log: Log, *,
                  argv: Sequence[str], scaled_slos: Sequence[ScaledSlo] = ()) -> None:  # fmt: skip
    """The files asked for: ``--json``, ``--plot``, ``--html``."""
    labels = [t.label for t in targets]
    if args.json is not None:
        config = {"argv": list(argv), **s.to_json(),
                  "slo_scales": [f.to_json() for f in scaled_slos]}  # fmt: skip
        doc = to_json(result, targets, config=config, machine=machine)
        args.json.write_text(json.dumps(doc) + "\n")
        log(f"wrote {args.json}")
    if args.plot is None and args.html is None:
        return
    from pdserve_bench.serve.plots import render_html, render_png

    png = render_png(result, labels, slo=s.slo, goal=args.goodput_target)
    if args.plot is not None:
        args.plot.write_bytes(png)
        log(f"wrote {args.plot}")
    if args.html is not None:
        notes = [s.headline(), f"SLO: TTFT <= {s.slo.ttft_s:g} s, per-request p99 ITL <= "
                 f"{s.slo.itl_s * 1e3:g} ms", f"machine: {machine}"]  # fmt: skip
        args.html.write_text(render_html(result, labels, title="pdserve bench serve",
                                         notes=notes, png=png))  # fmt: skip
        log(f"wrote {args.html}")
