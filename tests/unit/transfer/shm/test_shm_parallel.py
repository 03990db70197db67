"""The shm transport with a pool: the sender writes every other layer on a pool thread, the
receiver hashes K on a pool thread and V on its own."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import KVTransferError
from pdserve.transfer.base import KVLocation, TransferState
from pdserve.transfer.janitor import SHM_DIR
from pdserve.transfer.shm import checksum, segment
from pdserve.transfer.shm import writer as shm_writer
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.writer import SegmentWriter
from pdserve.transfer.stamp import CAPABILITY_OFFSET, HEADER_OFFSET
from tests.unit.transfer.conftest import (
    assert_same_payload,
    leftovers,
    make_layout,
    random_payload,
)
from tests.unit.transfer.shm.test_checksum import CountingPool, reference_bytes, reference_checksum


@pytest.fixture
def pool() -> Iterator[CountingPool]:
    """A counting one-thread pool."""
    with CountingPool() as executor:
        yield executor


def strided_payload(num_tokens: int, num_layers: int = 3) -> KVPayload:
    """A bfloat16 payload whose K and V are non-contiguous views, as the engine's hook may
    give them: K every other head of a wider tensor, V a [T, kvh, hd] view of [kvh, T, hd]."""
    layout = make_layout("bfloat16", num_layers=num_layers)
    g = torch.Generator().manual_seed(3)
    kvh, hd = layout.num_kv_heads, layout.head_dim
    keys = tuple(
        torch.randn(num_tokens, 2 * kvh, hd, generator=g).to(torch.bfloat16)[:, ::2]
        for _ in range(num_layers)
    )
    values = tuple(
        torch.randn(kvh, num_tokens, hd, generator=g).to(torch.bfloat16).transpose(0, 1)
        for _ in range(num_layers)
    )
    return KVPayload(layout, num_tokens, keys, values)


def send(
    prefix: str, payload: KVPayload, pool: CountingPool | None, rid: str
) -> tuple[KVLocation, tuple[int, ...]]:
    """The sealed segment's location and its layer checksums."""
    sender = SegmentWriter(prefix=prefix, pool=pool)
    sender.begin(rid, payload.layout, payload.num_tokens)
    for i in range(payload.layout.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    return sender.finish(), sender.checksums


def test_one_thread_and_two_write_the_same_segment(shm_prefix: str, pool: CountingPool) -> None:
    payload = strided_payload(num_tokens=37)
    alone, alone_sums = send(shm_prefix, payload, None, "alone")
    assert pool.submitted == 0
    paired, paired_sums = send(shm_prefix, payload, pool, "paired")
    lanes = (payload.layout.num_layers + 1) // 2
    assert pool.submitted == lanes  # every other layer went to the pool
    expected = tuple(
        reference_checksum(reference_bytes(k), reference_bytes(v))
        for k, v in zip(payload.keys, payload.values, strict=True)
    )
    assert alone_sums == paired_sums == expected
    # Byte for byte the same, but for each hand-off's own random capability.
    on_disk = [bytearray((SHM_DIR / d.key).read_bytes()) for d in (alone, paired)]
    assert [bytes(b[CAPABILITY_OFFSET:HEADER_OFFSET]) for b in on_disk] == [
        alone.capability,
        paired.capability,
    ]
    for b in on_disk:
        b[CAPABILITY_OFFSET:HEADER_OFFSET] = bytes(HEADER_OFFSET - CAPABILITY_OFFSET)
    assert on_disk[0] == on_disk[1]
    for desc in (alone, paired):
        receiver = SegmentReader(pool=pool, inline_bytes=0)  # in a worker thread, with the pool
        got = asyncio.run(receiver.receive(desc, timeout_s=5.0))
        assert_same_payload(got, payload)  # the strided views' values, byte for byte
    assert pool.submitted == lanes + 2  # and one K pass per receive
    assert leftovers(shm_prefix) == []


@pytest.mark.parametrize("with_pool", [False, True])
@pytest.mark.parametrize("where", ["K", "V"])
def test_a_flipped_byte_in_k_or_v_fails_its_layer(
    shm_prefix: str, pool: CountingPool, with_pool: bool, where: str
) -> None:
    payload = random_payload(make_layout(num_layers=3), 9)
    desc, _ = send(shm_prefix, payload, pool if with_pool else None, "r")
    path = SHM_DIR / desc.key
    fd = os.open(path, os.O_RDONLY)
    try:
        geom = segment.read_header(fd, 0, desc.key, desc.capability).geom
    finally:
        os.close(fd)
    # A byte inside layer 1's K (its 5th) or V (the 5th of its second half).
    at = geom.layer_offset(1) + 5 + (geom.layer_bytes // 2 if where == "V" else 0)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    # With the pool: read in a worker thread, K hashed on the pool; without: read inline.
    receiver = SegmentReader(pool=pool, inline_bytes=0) if with_pool else SegmentReader()
    with pytest.raises(KVTransferError, match="layer 1 failed its checksum"):
        asyncio.run(receiver.receive(desc, timeout_s=5.0))
    assert receiver.state is TransferState.FAILED and leftovers(shm_prefix) == []


@pytest.mark.parametrize("inline", [True, False])
def test_a_small_segment_is_read_on_the_callers_thread(
    shm_prefix: str, pool: CountingPool, inline: bool
) -> None:
    payload = random_payload(make_layout(num_layers=3), 9)
    desc, _ = send(shm_prefix, payload, None, "r")
    # Just big enough to read inline, or one byte short of it.
    receiver = SegmentReader(pool=pool, inline_bytes=desc.length - (0 if inline else 1))
    readers: list[str] = []
    real_read = receiver._read

    def spying_read(*args: object, **kwargs: object) -> KVPayload:
        readers.append(threading.current_thread().name)
        return real_read(*args, **kwargs)  # type: ignore[arg-type]

    receiver._read = spying_read  # type: ignore[method-assign]

    async def receive() -> KVPayload:
        got = await receiver.receive(desc, timeout_s=5.0)
        readers.append(threading.current_thread().name)  # the event loop's thread
        return got

    assert_same_payload(asyncio.run(receive()), payload)
    on_loop = readers[0] == readers[1]
    assert on_loop is inline
    assert pool.submitted == (0 if inline else 1)  # inline: this thread hashes K and V alone
    assert receiver.state is TransferState.DONE and leftovers(shm_prefix) == []


def test_the_deadline_holds_on_both_threads(shm_prefix: str, pool: CountingPool) -> None:
    desc, _ = send(shm_prefix, random_payload(make_layout(num_layers=3), 6), pool, "r")
    fd = os.open(SHM_DIR / desc.key, os.O_RDONLY)
    try:
        head = segment.read_header(fd, 0, desc.key, desc.capability)
        with pytest.raises(KVTransferError, match="timed out at layer 0") as err:
            segment.read_payload(fd, 0, head, head.checksums, deadline=0.0, pool=pool)
        # The pool's half timed out as well, and says so rather than vanishing.
        assert any("timed out at layer 0" in note for note in err.value.__notes__)
    finally:
        os.close(fd)
        segment.unlink(SHM_DIR / desc.key)


def test_a_failed_pool_half_fails_the_send_and_leaves_nothing(
    shm_prefix: str, pool: CountingPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checksum.copy_and_hash

    def broken_off_the_main_thread(
        dst: np.ndarray, src: torch.Tensor, piece_bytes: int, *, torch_copy: bool = False
    ) -> int:
        if threading.current_thread() is not threading.main_thread():
            raise OSError("the pool's copy broke")
        return real(dst, src, piece_bytes, torch_copy=torch_copy)

    monkeypatch.setattr(shm_writer, "copy_and_hash", broken_off_the_main_thread)
    payload = random_payload(make_layout(num_layers=2), 4)
    sender = SegmentWriter(prefix=shm_prefix, pool=pool)
    sender.begin("r", payload.layout, 4)
    for i in range(2):
        sender.send_layer(i, payload.keys[i], payload.values[i])  # never raises: recorded
    assert pool.submitted == 1  # layer 0 on the pool (failed), layer 1 here
    with pytest.raises(KVTransferError, match="the pool's copy broke"):
        sender.finish()
    assert sender.state is TransferState.FAILED and leftovers(shm_prefix) == []
