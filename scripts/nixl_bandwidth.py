"""Raw NIXL bandwidth against pdserve's nixl transport, between two processes on this machine.

Usage::

    python scripts/nixl_bandwidth.py                       # 1 KB .. 256 MB, UCX's defaults
    UCX_TLS=tcp python scripts/nixl_bandwidth.py --sizes 1K,1M,64M --repeats 5

A target process plays the prefill side: it registers one buffer with its NIXL agent for the
raw reads, and a ``NixlPool`` for pdserve's. The initiator (this process) plays the decode
side, for each size:

* **raw**: one READ of ``size`` contiguous bytes of the target's registered buffer into a
  registered buffer here, timed from ``transfer`` to DONE, right after an untimed one (the
  library at its best: descriptors prepared beforehand, the connection busy);
* **ours**: a hand-off of a KV payload of about ``size`` bytes (the target's ``NixlSender``
  writes it and commits; ``NixlReceiver.receive`` here looks the agent up, checks the blocks,
  reads the tags, the blocks and the tags again, checks each layer's CRC-32 and copies the
  layers out, then notifies the target), timed as the receive.

The median of ``--repeats`` runs of each is reported with the ratio ours / raw (the wrapping's
cost: the checks, the copy out of the landing blocks, the two tag reads). Torch, numpy and
the ``pdserve[nixl]`` extra are needed.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from pdserve.engine.kv_payload import KVLayout
from pdserve.transfer.nixl.agent import nixl_api
from pdserve.transfer.nixl.pool import NixlPool
from pdserve.transfer.nixl.reader import NixlReader, StaticDirectory
from pdserve.transfer.nixl.receiver import NixlReceiver
from pdserve.transfer.nixl.sender import NixlSender

LAYOUT = KVLayout("bench", "float32", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
TOKEN_BYTES = 2 * LAYOUT.num_layers * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4
BLOCK = 1 << 20
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def tokens_for(size: int) -> int:
    return max(1, size // TOKEN_BYTES)


def target(conn: Connection, largest: int) -> None:
    """The prefill side: a raw buffer and a pool, both registered once."""
    api = nixl_api()
    pool = NixlPool(num_bytes=largest + 64 * BLOCK, block_bytes=BLOCK, name="bench-target")
    raw = torch.ones(largest, dtype=torch.uint8)
    registration = pool.agent.register_memory(raw)
    conn.send((api.__name__, pool.agent.get_agent_metadata(), raw.data_ptr()))
    g = torch.Generator().manual_seed(0)
    while True:
        command = conn.recv()
        if command is None:
            break
        pool.sweep()
        n = tokens_for(command)
        shape = (n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        sender = NixlSender(pool)
        sender.begin(f"bench-{time.monotonic_ns()}", LAYOUT, n)
        for i in range(LAYOUT.num_layers):
            sender.send_layer(i, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        conn.send((asyncio.run(sender.commit(10.0)), pool.published, pool.fingerprint))
    pool.agent.deregister_memory(registration)
    pool.close()


async def raw_read(reader: NixlReader, agent: str, remote_addr: int, size: int) -> float:
    """Seconds of one READ of ``size`` bytes into the reader's own registered memory."""
    a = reader.agent
    local = a.get_xfer_descs(np.array([(reader.base, size, 0)], dtype=np.uint64), "DRAM")
    remote = a.get_xfer_descs(np.array([(remote_addr, size, 0)], dtype=np.uint64), "DRAM")
    handle = a.initialize_xfer("READ", local, remote, agent)
    try:
        start = time.perf_counter()
        state = a.transfer(handle)
        pause = 0.00005
        while state == "PROC":
            time.sleep(pause)  # lets NIXL's progress thread run (2-core machines)
            pause = min(pause * 2, 0.001)
            state = a.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
    finally:
        a.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"raw READ ended in {state}")
    return elapsed


async def measure(
    conn: Connection, sizes: list[int], repeats: int
) -> list[tuple[int, float, float]]:
    module, metadata, raw_addr = conn.recv()
    directory = StaticDirectory()
    largest = max(sizes)
    reader = NixlReader(directory, num_bytes=2 * largest + 64 * BLOCK, block_bytes=BLOCK)
    agent = reader.agent.add_remote_agent(metadata)
    agent = agent.decode() if isinstance(agent, bytes) else agent
    out = []
    try:
        for size in sizes:
            raws, ours = [], []
            for _ in range(repeats + 1):  # the first of each: warm-up, not counted
                # The library at its best: a READ right after another (the first after a
                # hand-off waits for the previous notification's progress, ~2-3 ms here).
                await raw_read(reader, agent, raw_addr, size)
                raws.append(size / await raw_read(reader, agent, raw_addr, size))
                conn.send(size)
                location, published, fp = conn.recv()
                directory.publish(location.address, published, fp)
                receiver = NixlReceiver(reader, location, expected_layout=LAYOUT)
                await receiver.receive(60.0)
                ours.append(
                    location.length
                    * 1e9
                    / (receiver.record.recv_end_ns - receiver.record.recv_start_ns)
                )
            out.append((size, statistics.median(raws[1:]), statistics.median(ours[1:])))
            print(
                f"  {size:>11d} B  raw {out[-1][1] / 1e9:7.3f} GB/s  ours {out[-1][2] / 1e9:7.3f} "
                f"GB/s  ({out[-1][2] / out[-1][1]:.0%})",
                file=sys.stderr,
                flush=True,
            )
        print(f"NIXL module: {module}", file=sys.stderr)
    finally:
        conn.send(None)
        reader.close()
    return out


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    tls = os.environ.get("UCX_TLS", "UCX defaults")
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}, UCX_TLS={tls}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="1K,16K,256K,1M,4M,16M,64M,256M")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    sizes = [parse_size(x) for x in args.sizes.split(",") if x]
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=target, args=(there, max(sizes)), daemon=True)
    child.start()
    try:
        rows = asyncio.run(measure(here, sizes, args.repeats))
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    print(f"machine: {machine()}")
    print("| payload | raw NIXL READ GB/s | pdserve nixl GB/s | ours / raw |")
    print("|---:|---:|---:|---:|")
    for size, raw, ours in rows:
        print(f"| {size:,} B | {raw / 1e9:.3f} | {ours / 1e9:.3f} | {ours / raw:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
