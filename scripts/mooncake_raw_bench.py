"""Mooncake Store's own put and get bandwidth, the library alone: the reference that
``pdserve bench transfer --transports mooncake`` is compared with (docs/benchmarks.md).

Usage::

    python scripts/mooncake_raw_bench.py                      # 16, 64 and 256 MiB, 5 rounds
    python scripts/mooncake_raw_bench.py --mib 4,64 --rounds 9

The same shape as the benchmark's hand-off: a ``mooncake_master``; a writer process lending
2 GiB (as the benchmark's prefill workers do) that ``put_from``s a buffer it filled once; a
reader process lending 256 MiB (a decode worker's default) that ``get_into``s a fresh buffer,
then removes the object. Mooncake places each object in one of the two segments. Each line is
the median of the rounds, with their range; the Transfer Engine runs over TCP on loopback.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdserve.kvstore.mooncake import MasterProcess, MooncakeAddress, load

_MIB = 1 << 20


def _join(address: str, host: str, segment: str) -> Any:
    config = MooncakeAddress.parse(f"{address}&segment={segment}")
    store = load().store_class()
    rc = store.setup(
        host, config.metadata, config.segment_bytes, config.buffer_bytes, config.protocol,
        config.devices, config.master,
    )  # fmt: skip
    if rc != 0:
        raise SystemExit(f"joining {config.master} failed (code {rc})")
    return store


def reader(address: str, conn: Connection) -> None:
    """The reader process: for each key it is sent, get it, remove it, answer the seconds."""
    store = _join(address, "127.0.0.1", "256MiB")
    conn.send("ready")
    while (key := conn.recv()) is not None:
        start = time.perf_counter()
        size = store.get_size(key)
        buffer = np.empty(size, dtype=np.uint8)
        got = store.get_into(key, buffer.ctypes.data, size)
        seconds = time.perf_counter() - start
        store.remove(key, True)
        conn.send((seconds, got == size))
    store.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", default="16,64,256", help="object sizes, MiB")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    sizes = [int(x) * _MIB for x in args.mib.split(",") if x]
    with MasterProcess() as master:
        address = master.address()
        here, there = mp.Pipe()
        child = mp.get_context("spawn").Process(target=reader, args=(address, there))
        child.start()
        try:
            assert here.recv() == "ready"
            store = _join(address, "127.0.0.1", "2GiB")
            print("| MiB | put GB/s (median, range) | get GB/s (median, range) |")
            print("|---|---|---|")
            for size in sizes:
                data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
                puts, gets = [], []
                for i in range(args.rounds):
                    key = f"raw/{size}/{i}"
                    start = time.perf_counter()
                    rc = store.put_from(key, data.ctypes.data, size)
                    puts.append(size / (time.perf_counter() - start) / 1e9)
                    if rc != 0:
                        raise SystemExit(f"put of {size} bytes failed (code {rc})")
                    here.send(key)
                    seconds, whole = here.recv()
                    if not whole:
                        raise SystemExit(f"get of {size} bytes came back short")
                    gets.append(size / seconds / 1e9)
                print(
                    f"| {size // _MIB} | {statistics.median(puts):.2f} ({min(puts):.2f}-"
                    f"{max(puts):.2f}) | {statistics.median(gets):.2f} ({min(gets):.2f}-"
                    f"{max(gets):.2f}) |",
                    flush=True,
                )
            store.close()
        finally:
            here.send(None)
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
