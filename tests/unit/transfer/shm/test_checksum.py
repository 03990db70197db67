"""Layer checksums: XXH3-64 of K and of V combined, computed piecewise while copying (on one
thread or two), and the shm segment's use."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import mmap
import os
import platform
import shutil
import struct
import sysconfig
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from pdserve.engine.kv_arrays import host_array
from pdserve.errors import KVTransferError
from pdserve.transfer.base import TransferState
from pdserve.transfer.shm import checksum, segment, writer
from pdserve.transfer.shm.checksum import (
    NATIVE,
    NATIVE_MODULE,
    combine,
    copy_and_hash,
    cpu_flags,
    in_pair,
    kv_checksum,
    layer_checksum,
)
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.writer import SegmentWriter
from tests.unit.transfer.conftest import (
    assert_same_payload,
    leftovers,
    make_layout,
    random_payload,
)


def test_layer_checksum_is_xxh3_64() -> None:
    data = bytes(range(256)) * 41
    assert layer_checksum(data) == xxhash.xxh3_64(data).intdigest()
    assert layer_checksum(memoryview(data)[3:]) == xxhash.xxh3_64(data[3:]).intdigest()


def reference_bytes(*parts: torch.Tensor) -> bytes:
    """The bytes of ``parts`` back to back, each made contiguous by torch (the reference)."""
    return (
        torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts]).numpy().tobytes()
    )


def reference_checksum(k: bytes, v: bytes) -> int:
    digests = struct.pack("<QQ", xxhash.xxh3_64(k).intdigest(), xxhash.xxh3_64(v).intdigest())
    return xxhash.xxh3_64(digests).intdigest()


def test_kv_checksum_combines_the_two_digests() -> None:
    k, v = bytes(range(256)) * 9, bytes(range(255, -1, -1)) * 9
    assert kv_checksum(k, v) == reference_checksum(k, v)
    assert kv_checksum(k, v) != kv_checksum(v, k)  # the order of K and V counts


def strided_kv(dtype: torch.dtype, tokens: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """A K that is every other head of a wider tensor and a V that is a [T, kvh, hd] view of
    a [kvh, T, hd] tensor (both non-contiguous), [tokens, 2, 8] each."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(tokens, 4, 8, generator=g).to(dtype)[:, ::2]
    v = torch.randn(2, tokens, 8, generator=g).to(dtype).transpose(0, 1)
    assert not k.is_contiguous() and not v.is_contiguous()
    return k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("piece_bytes", [1, 48, 100, 1 << 20])
@pytest.mark.parametrize("torch_copy", [False, True])
def test_copy_and_hash_copies_strided_views_then_hashes_what_it_wrote(
    dtype: torch.dtype, piece_bytes: int, torch_copy: bool
) -> None:
    """numpy's copy (a lane of its own) or torch's: the bytes of ``torch.cat``, hashed as one."""
    k, v = strided_kv(dtype)
    expected = reference_bytes(k, v)
    half = len(expected) // 2
    dst = np.full(len(expected), 0xEE, dtype=np.uint8)
    kd = copy_and_hash(dst[:half], k, piece_bytes, torch_copy=torch_copy)
    vd = copy_and_hash(dst[half:], v, piece_bytes, torch_copy=torch_copy)
    assert dst.tobytes() == expected
    assert combine(kd, vd) == reference_checksum(expected[:half], expected[half:])


def test_the_one_pass_copy_is_built_where_a_compiler_is() -> None:
    """The install builds ``_hashcopy`` on any machine with a C compiler (it falls back to
    numpy only without one): a broken build must not pass unnoticed."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the numpy path is the one in use")
    assert NATIVE
    if platform.machine() == "x86_64" and "avx2" in cpu_flags():
        assert NATIVE_MODULE == "_hashcopy_avx2"  # the faster build is the one in use


def _builds() -> list[str]:
    """The builds of the one-pass copy that exist and can run on this CPU."""
    names = ["_hashcopy"] + (["_hashcopy_avx2"] if "avx2" in cpu_flags() else [])
    return [n for n in names if importlib.util.find_spec(f"pdserve.transfer.{n}") is not None]


needs_native = pytest.mark.skipif(not NATIVE, reason="_hashcopy was not built (no C compiler)")


@needs_native
@pytest.mark.parametrize("build", _builds())
@pytest.mark.parametrize("num_bytes", [0, 1, 63, 64, 65, 4095, 65536, 65537, 3 * 65536 + 17])
@pytest.mark.parametrize("dst_offset", [0, 1, 8, 15])
def test_one_pass_copy_writes_the_bytes_and_their_xxh3(
    build: str, num_bytes: int, dst_offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heads and tails around the 16-byte aligned streamed middle, pieces of 64 KiB, each
    build: the destination holds the source's bytes, nothing around it is touched, the
    checksum is the xxhash package's, as numpy's copy and hash give it."""
    module = importlib.import_module(f"pdserve.transfer.{build}")
    monkeypatch.setattr(checksum, "_hash_copy", module.hash_copy)
    g = torch.Generator().manual_seed(num_bytes)
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g)
    if num_bytes % 2 == 0:  # a bf16 [T, 2, 4]-like source where the size allows
        src = src.view(torch.bfloat16)
    expected = src.view(torch.uint8).numpy().tobytes()
    buf = np.full(num_bytes + dst_offset + 16, 0xEE, dtype=np.uint8)
    dst = buf[dst_offset : dst_offset + num_bytes]
    digest = copy_and_hash(dst, src, 1 << 20)
    assert dst.tobytes() == expected
    assert (buf[:dst_offset] == 0xEE).all() and (buf[dst_offset + num_bytes :] == 0xEE).all()
    assert digest == xxhash.xxh3_64_intdigest(expected)
    monkeypatch.setattr(checksum, "_hash_copy", None)  # numpy's copy and the xxhash package
    again = np.zeros(num_bytes, dtype=np.uint8)
    assert copy_and_hash(again, src, 100) == digest
    assert again.tobytes() == expected


@needs_native
@pytest.mark.parametrize("build", _builds())
@pytest.mark.parametrize("num_bytes", [0, 1, 63, 240, 65535, 65536, 3 * 65536 + 17])
def test_gil_free_hash_is_the_xxhash_packages(
    build: str, num_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hash64`` (the reader's checks; it releases the GIL from 64 KiB on) gives the
    ``xxhash`` package's XXH3-64 for bytes, a view into an mmap and a numpy array, and
    ``layer_checksum`` is the same with or without it."""
    hash64 = importlib.import_module(f"pdserve.transfer.{build}").hash64
    data = np.random.default_rng(num_bytes).integers(0, 256, num_bytes + 5, dtype=np.uint8)
    expected = xxhash.xxh3_64_intdigest(data[5:].tobytes())
    with mmap.mmap(-1, max(1, num_bytes + 5)) as mm:
        mm[: num_bytes + 5] = data.tobytes()
        with memoryview(mm)[5 : 5 + num_bytes] as view:
            assert hash64(view) == expected
    assert hash64(data[5:].tobytes()) == hash64(data[5:]) == expected
    monkeypatch.setattr(checksum, "_hash64", hash64)
    assert layer_checksum(data[5:].data) == expected
    monkeypatch.setattr(checksum, "_hash64", None)
    assert layer_checksum(data[5:].data) == expected
    with pytest.raises((TypeError, BufferError, ValueError)):  # not contiguous
        hash64(np.zeros(200, dtype=np.uint8)[::2])


@needs_native
@pytest.mark.parametrize("build", _builds())
def test_one_pass_copy_rejects_bad_buffers(build: str) -> None:
    hash_copy = importlib.import_module(f"pdserve.transfer.{build}").hash_copy

    src = np.arange(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="dst has 99 bytes, src 100"):
        hash_copy(np.zeros(99, dtype=np.uint8), src, 64)
    with pytest.raises(ValueError, match="piece_bytes must be >= 1"):
        hash_copy(np.zeros(100, dtype=np.uint8), src, 0)
    with pytest.raises(TypeError):  # read-only destination
        hash_copy(bytes(100), src, 64)
    with pytest.raises((TypeError, BufferError, ValueError)):  # not contiguous
        hash_copy(np.zeros(200, dtype=np.uint8)[::2], src, 64)


def test_a_layer_written_either_way_reads_back_the_same(
    shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contiguous K and V (as the engine's hook gives them) through a two-lane sender,
    one-pass or numpy: the same checksums, and the receiver accepts both."""
    payload = random_payload(make_layout(num_layers=4), 37)
    descs, sums = [], []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for native in (NATIVE, False):
            if not native:
                monkeypatch.setattr(checksum, "_hash_copy", None)
            sender = SegmentWriter(prefix=shm_prefix, pool=pool)
            sender.begin(f"r{native}", payload.layout, 37)
            for i in range(4):
                sender.send_layer(i, payload.keys[i], payload.values[i])
            descs.append(sender.finish())
            sums.append(sender.checksums)
            got = asyncio.run(SegmentReader().receive(descs[-1], timeout_s=5.0))
            assert_same_payload(got, payload)
    assert sums[0] == sums[1] and len(sums[0]) == 4


class CountingPool(ThreadPoolExecutor):
    """A one-thread pool that counts what it was given."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def fail(err: Exception) -> int:
    raise err


def test_in_pair_waits_for_the_pool_half_before_raising() -> None:
    second_failed, first_done = threading.Event(), threading.Event()

    def first() -> int:
        # Runs on until the caller's half has failed: in_pair must still wait for it.
        if not second_failed.wait(timeout=30):
            raise RuntimeError("second never ran")
        first_done.set()
        raise KeyError("first broke too")

    def second() -> int:
        second_failed.set()
        raise OSError("second broke")

    with ThreadPoolExecutor(max_workers=1) as pool:
        with pytest.raises(OSError, match="second broke") as err:
            in_pair(pool, first, second)
        assert first_done.is_set()
        assert any("first broke too" in note for note in err.value.__notes__)
        with pytest.raises(KeyError, match="alone"):
            in_pair(pool, lambda: fail(KeyError("alone")), lambda: 2)
        assert in_pair(pool, lambda: 1, lambda: 2) == (1, 2)
    assert in_pair(None, lambda: 1, lambda: 2) == (1, 2)


def test_segment_table_holds_the_layers_checksums(shm_prefix: str) -> None:
    payload = random_payload(make_layout(num_layers=2), 5)
    sender = SegmentWriter(prefix=shm_prefix)
    sender.begin("r", payload.layout, 5)
    for i in range(2):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    desc = sender.finish()
    for i in range(2):
        k, v = (t.numpy().tobytes() for t in (payload.keys[i], payload.values[i]))
        assert sender.checksums[i] == reference_checksum(k, v)
    got = asyncio.run(SegmentReader().receive(desc, timeout_s=5.0))
    assert_same_payload(got, payload)


def test_received_views_are_private_and_outlive_the_segment(shm_prefix: str) -> None:
    payload = random_payload(make_layout(num_layers=3), 6)
    sender = SegmentWriter(prefix=shm_prefix)
    sender.begin("r", payload.layout, 6)
    for i in range(3):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    got = asyncio.run(SegmentReader().receive(sender.finish(), timeout_s=5.0))
    assert leftovers(shm_prefix) == []  # unlinked, yet the views stay readable
    assert_same_payload(got, payload)
    got.keys[0][...] = 0  # a private mapping: writable, and nobody else sees the write
    assert np.array_equal(got.keys[1], host_array(payload.keys[1]))


def test_a_failed_mapping_fails_the_send_and_leaves_nothing(
    shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(
        fd: int, header: bytes, geom: segment.SegmentGeometry, capability: bytes
    ) -> mmap.mmap:
        os.close(fd)
        raise OSError("no mapping today")

    monkeypatch.setattr(writer.segment, "map_for_writing", refuse)
    payload = random_payload(make_layout(num_layers=2), 4)
    sender = SegmentWriter(prefix=shm_prefix)
    sender.begin("r", payload.layout, 4)
    sender.send_layer(0, payload.keys[0], payload.values[0])  # never raises: recorded
    with pytest.raises(KVTransferError, match="no mapping today"):
        sender.finish()
    assert sender.state is TransferState.FAILED and leftovers(shm_prefix) == []
