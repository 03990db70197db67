"""Trace tools: ``pdserve trace SUBCOMMAND``.

A sub-dispatcher like the top-level CLI: each subcommand's module is imported only when it
runs. To add one, add an entry to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence

from pdserve.cli import Command

SUBCOMMANDS: dict[str, Command] = {
    "report": Command(
        "pdserve.telemetry.report",
        "main_report",
        "per-stage latency breakdown (table, PNG, HTML) from Jaeger or a span file",
    ),
    "capture": Command(
        "pdserve.router.capture_cli",
        "main_capture",
        "record the routers' traffic (shape only, no text) as a trace to replay",
    ),
}


def _parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<10} {cmd.help}" for name, cmd in SUBCOMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="pdserve trace",
        description="Trace tools.",
        epilog=f"subcommands:\n{listing}\n\nrun 'pdserve trace NAME --help' for its options",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=sorted(SUBCOMMANDS), metavar="NAME")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main_trace(argv: Sequence[str]) -> int:
    """Entry of ``pdserve trace``: ``argv`` is what follows ``trace`` on the command line."""
    ns = _parser().parse_args(list(argv))
    cmd = SUBCOMMANDS[ns.name]
    handler: Callable[[Sequence[str]], int] = getattr(
        importlib.import_module(cmd.module), cmd.function
    )
    return int(handler(ns.args))
