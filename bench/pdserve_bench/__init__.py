"""Benchmarks: ``pdserve bench SUBCOMMAND`` (or ``pdserve-bench SUBCOMMAND``).

The distribution ``pdserve-bench`` (``bench/`` of the repository), apart from the runtime
package: it imports pdserve, pdserve never imports it (``pdserve bench`` imports it by name
when it runs).

A sub-dispatcher like the top-level CLI: each subcommand's module is imported only when it
runs. To add one, add an entry to ``SUBCOMMANDS`` (its handler takes the arguments after the
subcommand name and returns the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from pdserve.cli import Command
from pdserve.cli import main as pdserve_main

SUBCOMMANDS: dict[str, Command] = {
    "attention": Command(
        "pdserve_bench.attention_bench", "main", "native CPU attention kernels against torch SDPA"
    ),
    "control-plane": Command(
        "pdserve_bench.control_plane", "main", "request rate the router and schedulers carry"
    ),
    "engine": Command(
        "pdserve_bench.engine_bench", "main", "engine throughput beside HF transformers and vLLM"
    ),
    "faults": Command(
        "pdserve_bench.faults.cli", "main", "each kind of process killed under load: what was lost"
    ),
    "guided": Command(
        "pdserve_bench.guided_bench", "main", "structured output: compile, mask and step cost"
    ),
    "overhead": Command(
        "pdserve_bench.overhead", "main", "latency the service path adds over the engine alone"
    ),
    "serve": Command(
        "pdserve_bench.serve.cli", "main", "open-loop load: TTFT, ITL, goodput against rate"
    ),
    "sim-footprint": Command(
        "pdserve_bench.sim_footprint", "main", "memory and idle CPU of simulated workers"
    ),
    "transfer": Command(
        "pdserve_bench.transfer", "main", "KV hand-off bandwidth and share of TTFT per transport"
    ),
}


def _parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<10} {cmd.help}" for name, cmd in SUBCOMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Benchmarks.",
        epilog=f"benchmarks:\n{listing}\n\nrun 'pdserve bench NAME --help' for its options",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=sorted(SUBCOMMANDS), metavar="NAME")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main_bench(argv: Sequence[str]) -> int:
    """Entry of ``pdserve bench``: ``argv`` is what follows ``bench`` on the command line."""
    ns = _parser().parse_args(list(argv))
    cmd = SUBCOMMANDS[ns.name]
    handler: Callable[[Sequence[str]], int] = getattr(
        importlib.import_module(cmd.module), cmd.function
    )
    return int(handler(ns.args))


def main() -> int:
    """The ``pdserve-bench`` console script: ``pdserve bench`` with the same arguments."""
    return pdserve_main(["bench", *sys.argv[1:]])
