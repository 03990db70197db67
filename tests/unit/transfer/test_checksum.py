"""Layer checksums: XXH3-64, computed piecewise while copying, and the shm segment's use."""

from __future__ import annotations

import asyncio
import mmap
import os

import pytest
import torch
import xxhash

from pdserve.errors import KVTransferError
from pdserve.transfer import segment, shm
from pdserve.transfer.base import TransferState
from pdserve.transfer.checksum import copy_and_checksum, layer_checksum
from pdserve.transfer.shm import ShmReceiver, ShmSender
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


@pytest.mark.parametrize("rows", [1, 3, 7, 1000])
def test_copy_and_checksum_copies_then_hashes_what_it_wrote(rows: int) -> None:
    g = torch.Generator().manual_seed(1)
    # A strided K (every other head of a wider tensor) and a contiguous V, [11, 2, 8] each.
    k = torch.randn(11, 4, 8, generator=g).to(torch.bfloat16)[:, ::2]
    v = torch.randn(11, 2, 8, generator=g).to(torch.bfloat16)
    dst = torch.empty(2 * k.numel() * 2, dtype=torch.uint8)
    digest = copy_and_checksum(dst, (k, v), rows)
    half = dst.numel() // 2
    assert torch.equal(dst[:half].view(torch.bfloat16).view(11, 2, 8), k)
    assert torch.equal(dst[half:].view(torch.bfloat16).view(11, 2, 8), v)
    raw = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in (k, v)]
    expected = xxhash.xxh3_64(raw[0] + raw[1])
    assert digest == expected.intdigest()


def test_segment_table_holds_the_layers_xxh3(shm_prefix: str) -> None:
    payload = random_payload(make_layout(num_layers=2), 5)
    sender = ShmSender(prefix=shm_prefix)
    sender.begin("r", payload.layout, 5)
    for i in range(2):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    desc = sender.finish()
    for i in range(2):
        raw = payload.keys[i].numpy().tobytes() + payload.values[i].numpy().tobytes()
        assert desc.layer_checksums[i] == xxhash.xxh3_64(raw).intdigest()
    got = asyncio.run(ShmReceiver().receive(desc, timeout_s=5.0))
    assert_same_payload(got, payload)


def test_received_views_are_private_and_outlive_the_segment(shm_prefix: str) -> None:
    payload = random_payload(make_layout(num_layers=3), 6)
    sender = ShmSender(prefix=shm_prefix)
    sender.begin("r", payload.layout, 6)
    for i in range(3):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    got = asyncio.run(ShmReceiver().receive(sender.finish(), timeout_s=5.0))
    assert leftovers(shm_prefix) == []  # unlinked, yet the views stay readable
    assert_same_payload(got, payload)
    got.keys[0].zero_()  # a private mapping: writable, and nobody else sees the write
    assert torch.equal(got.keys[1], payload.keys[1])


def test_a_failed_mapping_fails_the_send_and_leaves_nothing(
    shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(fd: int, header: bytes, geom: segment.SegmentGeometry) -> mmap.mmap:
        os.close(fd)
        raise OSError("no mapping today")

    monkeypatch.setattr(shm.segment, "map_for_writing", refuse)
    payload = random_payload(make_layout(num_layers=2), 4)
    sender = ShmSender(prefix=shm_prefix)
    sender.begin("r", payload.layout, 4)
    sender.send_layer(0, payload.keys[0], payload.values[0])  # never raises: recorded
    with pytest.raises(KVTransferError, match="no mapping today"):
        sender.finish()
    assert sender.state is TransferState.FAILED and leftovers(shm_prefix) == []
