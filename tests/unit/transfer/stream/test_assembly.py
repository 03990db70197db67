"""The layer stream's format end to end: frames sealed by ``LayerCopy``, assembled in any
order by ``FrameCollector``, and every refusal (checksum, size, range, repeats, layout)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kv_arrays import dtype_name
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.kv_tensors import as_tensor
from pdserve.errors import KVPayloadMismatchError, KVTransferError
from pdserve.transfer.compress import Compression
from pdserve.transfer.stream.frames import FRAME_HEAD, FRAME_MAGIC, FrameCollector, LayerCopy
from pdserve.transfer.stream.header import StreamHeader
from tests.unit.transfer.conftest import assert_same_payload, make_layout, random_payload


def encoded(
    layer: int, k: torch.Tensor, v: torch.Tensor, compression: Compression = Compression.NONE
) -> bytes:
    """One whole frame's bytes, as the sender seals it (header, K, V)."""
    pieces = LayerCopy.take(layer, k, v).seal(1 << 30, compression)
    out = b""
    for piece in pieces:
        out += bytes(piece[2]) + bytes(piece[0]) if len(piece) == 3 else bytes(piece[0])
    return out


def frames_of(payload: KVPayload, compression: Compression = Compression.NONE) -> list[bytes]:
    return [
        encoded(i, payload.keys[i], payload.values[i], compression)
        for i in range(payload.layout.num_layers)
    ]


def collector(payload: KVPayload, **kwargs: object) -> FrameCollector:
    header = StreamHeader("r", payload.layout, payload.num_tokens)
    return FrameCollector(header, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_frames_in_any_order_rebuild_the_payload(dtype: str) -> None:
    layout = make_layout(dtype, num_layers=5)
    payload = random_payload(layout, 21)
    wire = frames_of(payload)
    random.Random(1).shuffle(wire)
    assembler = collector(payload, expected_layout=layout)
    for data in wire:
        assert not assembler.complete
        assembler.feed(data)
    assert assembler.complete
    assert_same_payload(assembler.build(), payload)


def test_frame_bytes_are_the_payload_wire_bytes() -> None:
    # Same K/V bytes as the whole-payload format (KVPayload.layer_bytes), so either can feed
    # the other.
    payload = random_payload(make_layout(), 7)
    for i, frame in enumerate(frames_of(payload)):
        assert frame[FRAME_HEAD.size :] == payload.layer_bytes(i)


def test_header_round_trip() -> None:
    header = StreamHeader("req-1", make_layout("bfloat16"), 33, Compression.INT8)
    assert StreamHeader.decode(header.encode()) == header
    with pytest.raises(KVTransferError, match="magic"):
        StreamHeader.decode(b"nonsense")
    with pytest.raises(KVPayloadMismatchError):
        StreamHeader.decode(header.encode()[:-5])


def test_corrupt_frame_refused() -> None:
    payload = random_payload(make_layout(), 4)
    data = bytearray(frames_of(payload)[1])
    data[-3] ^= 0x01
    with pytest.raises(KVTransferError, match="layer 1 failed its checksum"):
        collector(payload).feed(bytes(data))


def test_duplicate_and_out_of_range_and_missing() -> None:
    payload = random_payload(make_layout(), 4)
    frames = frames_of(payload)
    assembler = collector(payload)
    assembler.feed(frames[0])
    with pytest.raises(KVTransferError, match="twice"):
        assembler.feed(frames[0])
    assembler = collector(payload)
    assembler.feed(frames[0])
    _, _, klen, vlen, crc = FRAME_HEAD.unpack_from(frames[0])
    stray = FRAME_HEAD.pack(FRAME_MAGIC, 3, klen, vlen, crc) + frames[0][FRAME_HEAD.size :]
    with pytest.raises(KVTransferError, match="outside"):
        assembler.feed(stray)
    with pytest.raises(KVTransferError, match=r"\[1, 2\] never arrived"):
        assembler.build()


def test_wrong_layout_refused() -> None:
    sent = random_payload(make_layout("float32"), 4)
    with pytest.raises(KVPayloadMismatchError, match="dtype"):
        collector(sent, expected_layout=make_layout("bfloat16"))
    with pytest.raises(KVPayloadMismatchError, match="model_fingerprint"):
        collector(sent, expected_layout=make_layout(fingerprint="fp-b"))
    # Frames of another token count (or head layout) do not fit this payload.
    other = frames_of(random_payload(sent.layout, 5))[0]
    with pytest.raises(KVPayloadMismatchError, match="bytes"):
        collector(sent).feed(other[: len(frames_of(sent)[0])])


def test_truncated_or_foreign_frame() -> None:
    payload = random_payload(make_layout(), 4)
    data = frames_of(payload)[0]
    short = collector(payload)
    short.feed(data[:-1])
    with pytest.raises(KVTransferError, match="ended inside a frame"):
        short.build()
    with pytest.raises(KVTransferError, match="magic"):
        collector(payload).feed(b"XXXX" + data[4:])


def test_int8_stream() -> None:
    layout = make_layout("bfloat16")
    payload = random_payload(layout, 40)
    header = StreamHeader("r", layout, 40, Compression.INT8)
    assembler = FrameCollector(StreamHeader.decode(header.encode()))
    frames = frames_of(payload, Compression.INT8)
    for f in frames:
        assembler.feed(f)
    got = assembler.build()
    plain = sum(len(f) for f in frames_of(payload))
    assert sum(len(f) for f in frames) < 0.6 * plain
    for x, y in zip(got.keys + got.values, payload.keys + payload.values, strict=True):
        assert dtype_name(x) == "bfloat16" and x.shape == y.shape
        # Loose here; compress tests bound the error exactly.
        xf, yf = as_tensor(x, torch.bfloat16).float(), as_tensor(y, torch.bfloat16).float()
        assert (xf - yf).abs().max() < 0.05 * yf.abs().max()
