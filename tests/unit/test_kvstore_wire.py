"""The KVChunk codec against protobuf's own: same bytes meaning, either way round."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from google.protobuf.message import DecodeError

from pdserve.kvstore.wire import Chunk, decode, encode, received_as
from pdserve.v1 import kvstore_pb2

FIELDS = ("seq", "crc32", "last", "key", "header", "lease_s", "total_bytes", "cache")


def _random_chunk(rng: random.Random, data_len: int) -> Chunk:
    return Chunk(
        seq=rng.randrange(1 << 40),
        data=rng.randbytes(data_len),
        crc32=rng.randrange(1 << 32),
        last=rng.random() < 0.5,
        key=f"kv/{rng.randrange(10**9)}-é",
        header=rng.randbytes(rng.randrange(0, 300)),
        lease_s=rng.random() * 100,
        total_bytes=rng.randrange(1 << 50),
        cache=rng.random() < 0.5,
    )


@pytest.mark.parametrize("data_len", [0, 1, 127, 128, 16_383, 16_384, 1 << 20])
def test_encode_parses_as_the_protobuf_message(data_len: int) -> None:
    rng = random.Random(data_len)
    chunk = _random_chunk(rng, data_len)
    message = kvstore_pb2.KVChunk.FromString(encode(chunk))
    assert message.data == bytes(chunk.data)
    for name in FIELDS:
        assert getattr(message, name) == getattr(chunk, name), name


@pytest.mark.parametrize(("lead_len", "data_len"), [(28, 0), (28, 1 << 20), (200, 127), (1, 1)])
def test_a_lead_goes_in_front_of_the_data_in_the_same_field(lead_len: int, data_len: int) -> None:
    """A sender's ``lead`` is part of ``data`` on the wire: protobuf and ``decode`` both read
    the two as one field, and the decoded chunk has no lead of its own."""
    rng = random.Random(lead_len * 7 + data_len)
    chunk = _random_chunk(rng, data_len)
    chunk.lead = rng.randbytes(lead_len)
    raw = encode(chunk)
    assert kvstore_pb2.KVChunk.FromString(raw).data == chunk.lead + bytes(chunk.data)
    got = decode(raw)
    assert (bytes(got.data), got.lead) == (chunk.lead + bytes(chunk.data), b"")
    for name in FIELDS:
        assert getattr(got, name) == getattr(chunk, name), name


@pytest.mark.parametrize("data_len", [0, 5, 300, 70_000])
def test_decode_reads_what_protobuf_wrote(data_len: int) -> None:
    rng = random.Random(1000 + data_len)
    chunk = _random_chunk(rng, data_len)
    raw = kvstore_pb2.KVChunk(
        seq=chunk.seq,
        data=bytes(chunk.data),
        crc32=chunk.crc32,
        last=chunk.last,
        key=chunk.key,
        header=chunk.header,
        lease_s=chunk.lease_s,
        total_bytes=chunk.total_bytes,
        cache=chunk.cache,
    ).SerializeToString()
    got = decode(raw)
    assert bytes(got.data) == bytes(chunk.data)
    for name in FIELDS:
        assert getattr(got, name) == getattr(chunk, name), name


def test_data_from_a_memoryview_and_decoded_without_a_copy() -> None:
    source = bytearray(range(256)) * 64
    chunk = Chunk(seq=3, data=memoryview(source)[100:9000], crc32=7, last=True)
    raw = encode(chunk)
    got = decode(raw)
    assert isinstance(got.data, memoryview) and got.data.obj is raw
    assert bytes(got.data) == bytes(source[100:9000])
    assert (got.seq, got.crc32, got.last) == (3, 7, True)


def test_a_received_chunk_goes_out_as_the_message_it_came_in() -> None:
    raw = encode(Chunk(seq=5, data=bytes(range(256)) * 40, crc32=99))
    got = decode(raw)
    assert received_as(got) and encode(got) is raw
    # Anything else is a message of its own, as protobuf serializes the same fields.
    others = {
        "another seq": replace(got, seq=6),
        "a key": replace(got, key="k"),
        "last": replace(got, last=True),
        "a lead": replace(got, lead=b"h"),
        "part of the data": replace(got, data=got.data[1:]),
        "as many bytes of the message, elsewhere in it": replace(got, data=got.data.obj[:10240]),
        "the same bytes, copied": replace(got, data=memoryview(bytes(got.data))),
    }
    for why, chunk in others.items():
        out = encode(chunk)
        assert not received_as(chunk) and out is not raw, why
        expected = kvstore_pb2.KVChunk(
            seq=chunk.seq, data=chunk.lead + bytes(chunk.data), crc32=chunk.crc32,
            last=chunk.last, key=chunk.key,
        )  # fmt: skip
        assert kvstore_pb2.KVChunk.FromString(out) == expected, why


def test_fields_in_any_order_and_the_last_data_field_wins() -> None:
    # data first, then the scalars; then a second data field, as a merge of two messages.
    first = kvstore_pb2.KVChunk(data=b"old").SerializeToString()
    rest = kvstore_pb2.KVChunk(seq=9, key="k", last=True).SerializeToString()
    second = kvstore_pb2.KVChunk(data=b"new!").SerializeToString()
    raw = first + rest + second
    expected = kvstore_pb2.KVChunk.FromString(raw)
    got = decode(raw)
    assert bytes(got.data) == expected.data == b"new!"
    assert (got.seq, got.key, got.last) == (expected.seq, expected.key, expected.last)


@pytest.mark.parametrize(
    "raw",
    [
        bytes([0x22, 0x05, 1, 2]),  # data shorter than its length
        bytes([0x18]),  # seq without its varint
        bytes([0x18]) + b"\xff" * 11,  # an overlong varint
        bytes([0x0B]),  # wire type 3 (groups): not in this message
    ],
)
def test_malformed_input_is_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(raw)
