"""A prefill side's ``NixlPool`` and a decode side's ``NixlReader`` in one process, the pool
published in a ``StaticDirectory`` (what a heartbeat carries), for the transport's tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.transfer.nixl.pool import NixlPool
from pdserve.transfer.nixl.reader import NixlReader, StaticDirectory

BLOCK = 4096


@contextmanager
def nixl_pair(
    pool_bytes: int = 1 << 20, reader_bytes: int = 1 << 20, lease_s: float = 30.0
) -> Iterator[tuple[NixlPool, NixlReader]]:
    pool = NixlPool(num_bytes=pool_bytes, block_bytes=BLOCK, lease_s=lease_s)
    directory = StaticDirectory()
    directory.publish(pool.name, pool.published, pool.fingerprint)
    reader = NixlReader(directory, num_bytes=reader_bytes, block_bytes=BLOCK)
    try:
        yield pool, reader
    finally:
        reader.close()
        pool.close()


def nixl_leftovers(pool: NixlPool, reader: NixlReader) -> list[str]:
    """What the hand-offs left: held hand-offs and blocks not free on either side (after the
    readers' notifications arrived, within 5 s), but for the landing blocks live payloads
    lie in."""
    out = []
    held = pool.settle(5.0)
    if held:
        out.append(f"{held} held hand-offs")
    if pool.allocator.num_free != pool.allocator.num_blocks:
        out.append(f"{pool.allocator.num_blocks - pool.allocator.num_free} pool blocks taken")
    # Landing blocks a live payload lies in are its own until the engine imports it.
    if reader.allocator.num_free + reader.lent != reader.allocator.num_blocks:
        taken = reader.allocator.num_blocks - reader.allocator.num_free - reader.lent
        out.append(f"{taken} landing blocks taken, not lent to a payload")
    return out
