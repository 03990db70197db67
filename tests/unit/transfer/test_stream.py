"""LayerFrame and PayloadAssembler: framing, any-order assembly and every refusal."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import KVPayloadMismatchError, KVTransferError
from pdserve.transfer.compress import Compression
from pdserve.transfer.stream import LayerFrame, PayloadAssembler, StreamHeader
from tests.unit.transfer.conftest import assert_same_payload, make_layout, random_payload


def frames_of(payload: KVPayload, compression: Compression = Compression.NONE) -> list[LayerFrame]:
    return [
        LayerFrame.from_tensors(i, payload.keys[i], payload.values[i], compression)
        for i in range(payload.layout.num_layers)
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_frames_in_any_order_rebuild_the_payload(dtype: str) -> None:
    layout = make_layout(dtype, num_layers=5)
    payload = random_payload(layout, 21)
    wire = [f.encode() for f in frames_of(payload)]
    random.Random(1).shuffle(wire)
    assembler = PayloadAssembler(layout, 21, expected_layout=layout)
    for i, data in enumerate(wire):
        assert not assembler.complete and len(assembler.missing()) == 5 - i
        assembler.add_bytes(data)
    assert assembler.complete and assembler.missing() == []
    assert_same_payload(assembler.build(), payload)


def test_frame_bytes_are_the_payload_wire_bytes() -> None:
    # Same K/V bytes as the whole-payload format (KVPayload.layer_bytes), so either can feed
    # the other.
    payload = random_payload(make_layout(), 7)
    for i, frame in enumerate(frames_of(payload)):
        assert frame.keys + frame.values == payload.layer_bytes(i)


def test_header_round_trip() -> None:
    header = StreamHeader("req-1", make_layout("bfloat16"), 33, Compression.INT8)
    assert StreamHeader.decode(header.encode()) == header
    with pytest.raises(KVTransferError, match="magic"):
        StreamHeader.decode(b"nonsense")
    with pytest.raises(KVPayloadMismatchError):
        StreamHeader.decode(header.encode()[:-5])


def test_corrupt_frame_refused() -> None:
    payload = random_payload(make_layout(), 4)
    data = bytearray(frames_of(payload)[1].encode())
    data[-3] ^= 0x01
    assembler = PayloadAssembler(payload.layout, 4)
    with pytest.raises(KVTransferError, match="layer 1 failed its checksum"):
        assembler.add_bytes(bytes(data))
    assert assembler.missing() == [0, 1, 2]


def test_duplicate_and_out_of_range_and_missing() -> None:
    payload = random_payload(make_layout(), 4)
    frames = frames_of(payload)
    assembler = PayloadAssembler(payload.layout, 4)
    assembler.add(frames[0])
    with pytest.raises(KVTransferError, match="twice"):
        assembler.add(frames[0])
    stray = LayerFrame(3, frames[0].keys, frames[0].values, frames[0].crc32)
    with pytest.raises(KVTransferError, match="outside"):
        assembler.add(stray)
    with pytest.raises(KVTransferError, match=r"\[1, 2\] never arrived"):
        assembler.build()


def test_wrong_layout_refused() -> None:
    sent = make_layout("float32")
    with pytest.raises(KVPayloadMismatchError, match="dtype"):
        PayloadAssembler(sent, 4, expected_layout=make_layout("bfloat16"))
    with pytest.raises(KVPayloadMismatchError, match="model_fingerprint"):
        PayloadAssembler(sent, 4, expected_layout=make_layout(fingerprint="fp-b"))
    # Frames of another token count (or head layout) do not fit this payload.
    other = frames_of(random_payload(sent, 5))[0]
    with pytest.raises(KVPayloadMismatchError, match="bytes"):
        PayloadAssembler(sent, 4).add(other)


def test_truncated_or_foreign_frame() -> None:
    data = frames_of(random_payload(make_layout(), 4))[0].encode()
    with pytest.raises(KVTransferError, match="implies"):
        LayerFrame.decode(data[:-1])
    with pytest.raises(KVTransferError, match="truncated"):
        LayerFrame.decode(data[:10])
    with pytest.raises(KVTransferError, match="magic"):
        LayerFrame.decode(b"XXXX" + data[4:])


def test_int8_stream() -> None:
    layout = make_layout("bfloat16")
    payload = random_payload(layout, 40)
    header = StreamHeader("r", layout, 40, Compression.INT8)
    assembler = PayloadAssembler.from_header(StreamHeader.decode(header.encode()))
    frames = frames_of(payload, Compression.INT8)
    for f in frames:
        assembler.add_bytes(f.encode())
    got = assembler.build()
    plain = sum(len(f.keys) + len(f.values) for f in frames_of(payload))
    assert sum(len(f.keys) + len(f.values) for f in frames) < 0.6 * plain
    for x, y in zip(got.keys + got.values, payload.keys + payload.values, strict=True):
        assert x.dtype == torch.bfloat16 and x.shape == y.shape
        # Loose here; compress tests bound the error exactly.
        assert (x.float() - y.float()).abs().max() < 0.05 * y.float().abs().max()
