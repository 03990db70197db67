"""``FrameCollector`` keeping a layer's pieces as they came: a received header-and-K piece
and its V piece become the K and V tensors without a copy, anything else is copied together,
and every check (CRC, sizes, an unfinished frame) holds on both paths."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from pdserve.engine.kv_arrays import host_array
from pdserve.engine.kv_payload import KVLayout
from pdserve.errors import KVTransferError
from pdserve.kvstore import wire
from pdserve.kvstore.chunks import ChunkSequence
from pdserve.kvstore.client import Piece
from pdserve.transfer.compress import Compression
from pdserve.transfer.stream import frames
from pdserve.transfer.stream.frames import FRAME_HEAD, FrameCollector, LayerCopy, part_bytes
from pdserve.transfer.stream.header import StreamHeader

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

LAYOUT = KVLayout("fp", "bfloat16", 3, 2, 8, 16)
TOKENS = 5
PART = part_bytes(LAYOUT, TOKENS, Compression.NONE)


def _layers(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [
        (torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
        for _ in range(LAYOUT.num_layers)
    ]


def received(pieces: list[Piece]) -> list[tuple[bytes, int]]:
    """The pieces as a reader gets them: each a chunk through the wire codec (a frame's
    header in front of its first piece), its data and CRC-32 as they arrive."""
    sequence = ChunkSequence("k")
    chunks = [wire.decode(wire.encode(sequence.chunk(*piece))) for piece in pieces]
    return [(bytes(chunk.data), chunk.crc32) for chunk in chunks]


def _address(data: bytes) -> int:
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)


def _within(a: np.ndarray, data: bytes) -> bool:
    return _address(data) <= a.ctypes.data < _address(data) + len(data)


def same(a: KVArray, b: KVArray) -> bool:
    """Bit-equal: a received array against another, or against the tensor sent."""
    return np.array_equal(host_array(a), host_array(b))


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.INT8])
def test_received_pieces_that_line_up_become_the_tensors_without_a_copy(
    compression: Compression,
) -> None:
    layers = _layers(0)
    header = StreamHeader("r", LAYOUT, TOKENS, compression)
    collector = FrameCollector(header, expected_layout=LAYOUT)
    sent: list[tuple[bytes, int]] = []
    for i, (k, v) in enumerate(layers):
        pieces = received(LayerCopy.take(i, k, v).seal(1 << 20, compression))
        assert [len(p) for p, _ in pieces] == [
            FRAME_HEAD.size + len(pieces[1][0]),
            len(pieces[1][0]),
        ]
        for data, crc in pieces:
            collector.feed(data, crc)
        sent += pieces
    payload = collector.build()
    assert [bytes(part) for part in collector.frames] == [data for data, _ in sent]
    copied = FrameCollector(header)  # the same bytes, writable: copied together
    for data, crc in sent:
        copied.feed(bytearray(data), crc)
    reference = copied.build()
    for i, (k, v) in enumerate(layers):
        assert same(payload.keys[i], reference.keys[i])
        assert same(payload.values[i], reference.values[i])
        if compression is Compression.NONE:
            assert same(payload.keys[i], k) and same(payload.values[i], v)
            assert _within(payload.keys[i], sent[2 * i][0])
            assert _within(payload.values[i], sent[2 * i + 1][0])
            assert not _within(reference.keys[i], sent[2 * i][0])


def test_writable_pieces_are_copied_so_their_owner_may_reuse_them() -> None:
    (k, v), *_ = _layers(1)
    one = StreamHeader("r", KVLayout("fp", "bfloat16", 1, 2, 8, 16), TOKENS)
    collector = FrameCollector(one)
    buffers = [
        (bytearray(data), crc)
        for data, crc in received(LayerCopy.take(0, k, v).seal(1 << 20, Compression.NONE))
    ]
    for data, crc in buffers:
        collector.feed(data, crc)
    for data, _ in buffers:
        data[:] = bytes(len(data))  # the owner reuses its buffers
    payload = collector.build()
    assert same(payload.keys[0], k) and same(payload.values[0], v)


def test_a_kept_lead_whose_v_comes_in_pieces_is_copied_together() -> None:
    """Header and K in one piece, V in two: the kept piece is copied into the frame, and the
    frame's CRC still comes from the pieces' (nothing is hashed again but the header)."""
    layers = _layers(2)
    collector = FrameCollector(StreamHeader("r", LAYOUT, TOKENS))
    for i, (k, v) in enumerate(layers):
        (lead, lead_crc), (tail, _) = received(
            LayerCopy.take(i, k, v).seal(1 << 20, Compression.NONE)
        )
        collector.feed(lead, lead_crc)
        half = len(tail) // 2
        for part in (tail[:half], tail[half:]):
            collector.feed(part, zlib.crc32(part))
    payload = collector.build()
    for i, (k, v) in enumerate(layers):
        assert same(payload.keys[i], k) and same(payload.values[i], v)
    assert len(collector.frames) == LAYOUT.num_layers  # one frame buffer each


def test_a_flipped_byte_in_a_kept_piece_fails_the_frame() -> None:
    """The sender flips a byte of K after the frame's CRC (each chunk's own CRC is right):
    combining the kept pieces' CRCs does not match the frame's."""
    (k, v), *_ = _layers(3)
    original = k.clone()
    collector = FrameCollector(StreamHeader("r", LAYOUT, TOKENS))
    pieces = received(LayerCopy.take(0, k, v).seal(1 << 20, Compression.NONE, corrupt=True))
    assert same(k, original)  # the flip is on a copy: the hooked tensor is untouched
    assert all(zlib.crc32(p) == c for p, c in pieces)
    with pytest.raises(KVTransferError, match="checksum"):
        for data, crc in pieces:
            collector.feed(data, crc)


def test_a_stream_ending_after_a_kept_lead_is_refused() -> None:
    (k, v), *_ = _layers(4)
    collector = FrameCollector(StreamHeader("r", LAYOUT, TOKENS))
    (lead, crc), _ = received(LayerCopy.take(0, k, v).seal(1 << 20, Compression.NONE))
    collector.feed(lead, crc)
    with pytest.raises(
        KVTransferError, match=f"ended inside a frame \\({FRAME_HEAD.size + PART} bytes"
    ):
        collector.build()


def test_views_are_made_once_the_stream_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """No views are made while frames arrive (grpcio's threads compete for the GIL then):
    the K and V views are made by ``build()``, still over the received bytes."""
    made: list[int] = []
    from_buffer = frames.from_buffer

    def counting(data: memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        made.append(1)
        return from_buffer(data, dtype, shape)

    monkeypatch.setattr(frames, "from_buffer", counting)
    layers = _layers(5)
    collector = FrameCollector(StreamHeader("r", LAYOUT, TOKENS))
    sent = [
        piece
        for i, (k, v) in enumerate(layers)
        for piece in received(LayerCopy.take(i, k, v).seal(1 << 20, Compression.NONE))
    ]
    for data, crc in sent:
        collector.feed(data, crc)
    assert collector.complete and not made
    payload = collector.build()
    assert len(made) == 2 * LAYOUT.num_layers
    for i, (k, v) in enumerate(layers):
        assert same(payload.keys[i], k) and same(payload.values[i], v)
        assert _within(payload.keys[i], sent[2 * i][0])
