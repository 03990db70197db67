"""Mooncake Store's own put and get bandwidth, the library alone: the reference that
``pdserve bench transfer --transports mooncake`` is compared with (docs/benchmarks.md).

Usage::

    python scripts/mooncake_raw_bench.py                      # 16, 64 and 256 MiB, 5 rounds
    python scripts/mooncake_raw_bench.py --mib 4,64 --rounds 9
    python scripts/mooncake_raw_bench.py --paired             # pdserve's client against it

The same shape as the benchmark's hand-off: a ``mooncake_master``; a writer process lending
1 GiB (as the benchmark's prefill workers do) that ``put_from``s a buffer it filled once; a
reader process lending as much (a decode worker joins with the address a handle carries,
segment included) that ``get_into``s a fresh buffer, then removes the object. Mooncake places
each object in one of the two segments. Each line is the median of the rounds, with their
range; the Transfer Engine runs over TCP on loopback.

``--paired`` measures what pdserve's wrapping costs, on a machine whose speed drifts: two
``MooncakeStoreClient``s in one process (a writer and a reader, each lending 1 GiB), and per
round one hand-off through them (``put_stream`` of a frame-like stream, then ``stream`` with
``delete_after_read``, CRCs included) right beside one through the library alone on the very
same joined stores (``put_from``, ``get_size`` + ``get_into``, ``remove``), in alternating
order; each line gives the medians and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdserve.kvstore.mooncake.address import MooncakeAddress
from pdserve.kvstore.mooncake.library import load
from pdserve.kvstore.mooncake.master import MasterProcess

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
    store = _join(address, "127.0.0.1", "1GiB")
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


async def _ours_once(writer: Any, reader: Any, key: str, data: np.ndarray) -> float:
    """One hand-off through pdserve's clients: a two-piece stream in, a deleting read out."""
    half = data.size // 2

    async def pieces() -> Any:
        yield data.data[:half], 0, b""
        yield data.data[half:], 0

    start = time.perf_counter()
    await writer.put_stream(key, pieces(), total_bytes=data.size)
    async for _ in reader.stream(key, delete_after_read=True):
        pass
    return float(data.size / (time.perf_counter() - start) / 1e9)


def _raw_once(raw_w: Any, raw_r: Any, key: str, data: np.ndarray) -> float:
    """The same hand-off through the library alone, on the same joined stores."""
    start = time.perf_counter()
    if raw_w.put_from(key, data.ctypes.data, data.size) != 0:
        raise SystemExit(f"put of {data.size} bytes failed")
    n = raw_r.get_size(key)
    out = np.empty(n, dtype=np.uint8)
    if raw_r.get_into(key, out.ctypes.data, n) != n:
        raise SystemExit(f"get of {data.size} bytes came back short")
    raw_r.remove(key, True)
    return float(data.size / (time.perf_counter() - start) / 1e9)


async def paired(address: str, sizes: list[int], n_rounds: int) -> None:
    """``--paired`` (see the module doc)."""
    from pdserve.kvstore.mooncake.client import MooncakeStoreClient

    writer = MooncakeStoreClient(f"{address}&segment=1GiB", timeout_s=60)
    reader = MooncakeStoreClient(f"{address}&segment=1GiB", timeout_s=60, local_host="127.0.0.2")
    raw_w, raw_r = await writer._joined(), await reader._joined()
    print("| MiB | pdserve hand-off GB/s | library hand-off GB/s | pdserve / library |")
    print("|---|---|---|---|")
    try:
        for size in sizes:
            data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
            ours, theirs, ratios = [], [], []
            for i in range(n_rounds):
                raw = asyncio.to_thread(_raw_once, raw_w, raw_r, f"raw/{size}/{i}", data)
                mine = _ours_once(writer, reader, f"ours/{size}/{i}", data)
                if i % 2:  # alternating order: neither always runs first
                    a = await mine
                    b = await raw
                else:
                    b = await raw
                    a = await mine
                ours.append(a)
                theirs.append(b)
                ratios.append(a / b)
            print(
                f"| {size // _MIB} | {statistics.median(ours):.2f} | "
                f"{statistics.median(theirs):.2f} | {statistics.median(ratios):.0%} "
                f"({min(ratios):.0%}-{max(ratios):.0%}) |",
                flush=True,
            )
    finally:
        await reader.close()
        await writer.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", default="16,64,256", help="object sizes, MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--paired", action="store_true", help="pdserve's client against the library")
    args = p.parse_args(argv)
    sizes = [int(x) * _MIB for x in args.mib.split(",") if x]
    if args.paired:
        with MasterProcess() as master:
            asyncio.run(paired(master.address(), sizes, args.rounds))
        return 0
    with MasterProcess() as master:
        address = master.address()
        here, there = mp.Pipe()
        child = mp.get_context("spawn").Process(target=reader, args=(address, there))
        child.start()
        try:
            assert here.recv() == "ready"
            store = _join(address, "127.0.0.1", "1GiB")
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
