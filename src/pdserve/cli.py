"""The ``pdserve`` command line: a dispatcher to one handler module per subcommand.

Each subcommand's module is imported only when that subcommand runs, so ``pdserve --help``
stays fast (no torch, grpc or transformers import). To add a subcommand, add one entry to
``COMMANDS``: its handler takes the arguments that follow the subcommand name and returns the
exit status, and parses them with its own ``argparse`` parser (so ``pdserve NAME --help`` works).

``pdserve bench`` is the entry point of a separate distribution, ``pdserve-bench`` (package
``pdserve_bench``, in ``bench/`` of the repository): the runtime never imports it, and without
it the command says in one line how to install it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.errors import PdServeError


@dataclass(frozen=True, slots=True)
class Command:
    """Where a subcommand's handler lives: ``module.function(argv) -> int``."""

    module: str
    function: str
    help: str
    install: str = ""
    """How to install the distribution that provides ``module``, when it is not pdserve's own:
    printed when its top-level package cannot be imported."""


COMMANDS: dict[str, Command] = {
    "model": Command("pdserve.models.demo", "main_model", "make demo checkpoints (model init)"),
    "bench": Command(
        "pdserve_bench",
        "main_bench",
        "benchmarks (bench engine; package pdserve-bench)",
        install="the benchmarks are a separate package, pdserve-bench: "
        "pip install -e ./bench in a pdserve checkout",
    ),
    "up": Command("pdserve.up", "main_up", "start a local cluster (Redis + all services)"),
    "certs": Command("pdserve.security.certs", "main_certs", "make a local CA and certificates"),
    "generate": Command("pdserve.client.cli", "main_generate", "stream a completion from a router"),
    "status": Command("pdserve.status", "main_status", "list live workers from Redis"),
    "rollout": Command(
        "pdserve.router.rollout_cli", "main_rollout", "traffic split between serving modes"
    ),
    "trace": Command(
        "pdserve.telemetry.cli", "main_trace", "trace tools (trace report, trace capture)"
    ),
    "sim": Command(
        "pdserve.sim.cli", "main_sim", "simulated accelerators (sim calibrate, sim plan)"
    ),
}


def _parser() -> argparse.ArgumentParser:
    commands = "\n".join(f"  {name:<10} {cmd.help}" for name, cmd in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/Decode-disaggregated LLM inference server.",
        epilog=f"commands:\n{commands}\n\nrun 'pdserve COMMAND --help' for a command's options",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pdserve COMMAND ARGS...``; returns the process exit status."""
    ns = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    cmd = COMMANDS[ns.command]
    try:
        module = importlib.import_module(cmd.module)
    except ModuleNotFoundError as e:
        # Only the separate distribution itself missing; a dependency missing inside it is a
        # broken install, whose traceback names what is missing.
        if not cmd.install or e.name != cmd.module.partition(".")[0]:
            raise
        print(f"pdserve {ns.command}: error: {cmd.install}", file=sys.stderr)
        return 2
    handler: Callable[[Sequence[str]], int] = getattr(module, cmd.function)
    try:
        return int(handler(ns.args))
    except PdServeError as e:  # an expected failure: a message, not a traceback
        print(f"pdserve {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
