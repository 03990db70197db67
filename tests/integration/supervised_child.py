"""A stand-in service for the supervisor's tests: ``--exit N`` exits at once with status N;
otherwise it writes the port it was given to its port file and waits for a signal."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--port-file", type=Path, required=True)
    p.add_argument("--exit", type=int)
    args = p.parse_args()
    if args.exit is not None:
        sys.exit(args.exit)
    tmp = args.port_file.with_name(args.port_file.name + ".tmp")
    tmp.write_text(f"{args.port}\n")
    os.replace(tmp, args.port_file)  # a reader never sees half a file
    signal.pause()  # SIGTERM's default action ends it


if __name__ == "__main__":
    main()
