"""The other share's load while ``pdserve sim calibrate`` measures one share of a split.

A host lease splits an engine's threads only while a long prefill runs beside decode steps,
so each share steps while the other is busy. Measured alone on an idle host, a share would
miss what the two cost each other (memory bandwidth, the shared cache, the cores' clocks).
``beside`` starts this module in a child process on the threads the share leaves: it loads
the same checkpoint and runs prefills and decode batches (``LOAD``, a ``CalibrationPlan``)
in a loop until its parent closes its stdin, or dies.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdserve.compute.omp import worker_omp_env
from pdserve.deathsig import stop, wrap
from pdserve.errors import WorkerUnavailableError
from pdserve.sim.calibrate import load_engine
from pdserve.sim.recording import CalibrationPlan, record_plan

READY = b"ready"
LOAD = CalibrationPlan(
    prompt_lengths=(256, 1024),
    decode_batches=(4, 16),
    decode_contexts=(256,),
    prefix_hits=((256, 256),),
    repeats=1,
    warmups=0,
)
"""What the companion runs, over and over: long and short prefills, small and large decode
batches, as the share beside a split's other share steps."""


@contextlib.contextmanager
def beside(model_dir: Path, threads: int, *, dtype: str) -> Iterator[None]:
    """While the block runs, ``threads`` threads step the engine on ``model_dir`` in a child
    process (started and ready before the block: its model loaded, its first steps run)."""
    argv = [sys.executable, "-m", "pdserve.sim.companion", str(model_dir), str(threads), dtype]
    proc = subprocess.Popen(
        wrap(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=worker_omp_env()
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != READY:
            raise WorkerUnavailableError(
                f"the calibration's companion load did not start (exit status {proc.wait()})"
            )
        yield
    finally:
        proc.stdin.close()
        stop(proc)


def main(args: Sequence[str]) -> None:
    """``python -m pdserve.sim.companion MODEL_DIR THREADS DTYPE``: run ``LOAD`` until stdin
    closes."""
    model_dir, threads, dtype = args
    engine = load_engine(Path(model_dir), LOAD, dtype=dtype, threads=int(threads))
    done = threading.Event()

    def watch() -> None:
        sys.stdin.buffer.read()  # returns at EOF: the parent closed it, or died
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    record_plan(engine, LOAD)
    sys.stdout.buffer.write(READY + b"\n")
    sys.stdout.buffer.flush()
    while not done.is_set():
        record_plan(engine, LOAD)


if __name__ == "__main__":
    main(sys.argv[1:])
