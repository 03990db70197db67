"""CRC-32 of a concatenation from its parts' CRCs (``pdserve.kvstore.crc``), checked against
``zlib.crc32`` of the concatenation itself, and chunk streams that keep the writer's CRCs."""

from __future__ import annotations

import random
import zlib

import pytest

from pdserve.kvstore.chunks import ChunkAssembler, ChunkSequence, split_parts
from pdserve.kvstore.crc import crc32_combine, fast_crc32
from pdserve.kvstore.wire import decode, encode


@pytest.mark.parametrize(
    ("len_a", "len_b"),
    [(0, 0), (0, 7), (7, 0), (1, 1), (3, 1000), (1 << 16, 12345), (999, 1 << 20)],
)
def test_combine_equals_the_crc_of_the_concatenation(len_a: int, len_b: int) -> None:
    rng = random.Random(len_a * 31 + len_b)
    a, b = rng.randbytes(len_a), rng.randbytes(len_b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("length", [0, 1, 15, 64, 1000, (1 << 20) + 3])
def test_fast_crc32_is_zlibs(length: int) -> None:
    data = random.Random(length).randbytes(length)
    assert fast_crc32(data) == zlib.crc32(data)
    assert fast_crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])
    assert fast_crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)  # continued


def test_combine_folds_many_pieces() -> None:
    rng = random.Random(5)
    pieces = [rng.randbytes(rng.randrange(0, 5000)) for _ in range(40)]
    crc = 0
    for p in pieces:
        crc = crc32_combine(crc, zlib.crc32(p), len(p))
    assert crc == zlib.crc32(b"".join(pieces))


def test_split_parts_keeps_known_crcs_and_splits_the_rest() -> None:
    small, big, unknown = b"a" * 10, b"b" * 2500, b"c" * 1500
    chunks = list(
        split_parts(
            [(small, 123), (big, zlib.crc32(big)), (unknown, None)],
            key="k",
            header=b"H",
            chunk_bytes=1000,
        )
    )
    # The small piece keeps its (deliberately wrong) CRC as given: the store passes on what
    # its writer's chunk carried; the big one and the unknown one are split and checksummed.
    assert [len(c.data) for c in chunks] == [10, 1000, 1000, 500, 1000, 500]
    assert chunks[0].crc32 == 123 and all(c.crc32 == zlib.crc32(c.data) for c in chunks[1:])
    assert [c.last for c in chunks] == [False] * 5 + [True]
    assert (chunks[0].key, chunks[0].header, chunks[0].total_bytes) == ("k", b"H", 1 + 4010)
    asm = ChunkAssembler()
    for c in chunks[1:]:
        c.seq -= 1
        if c.seq == 0:
            c.key, c.header, c.total_bytes = "k", b"", 4000
        asm.feed(c)
    assert asm.finish() == big + unknown


def test_a_part_a_frame_header_over_a_chunk_goes_out_whole() -> None:
    """A layer frame's first piece is a chunk of K with the frame header in front: within
    1/64 of a chunk over, a part with its CRC leaves as one chunk; further over, it is split."""
    lead, over = b"h" * 1028, b"o" * 1100
    chunks = list(
        split_parts([(lead, zlib.crc32(lead)), (over, zlib.crc32(over))], chunk_bytes=1024)
    )
    assert [len(c.data) for c in chunks] == [1028, 1024, 76]
    assert all(c.crc32 == zlib.crc32(c.data) for c in chunks)


def test_parts_put_as_a_sequence_go_out_in_the_messages_they_came_in() -> None:
    """A writer's stream (an empty first chunk, the data, an empty last one), received and
    kept as its chunks' data, goes out numbered as it came: each data chunk's message is the
    one it arrived in, not a copy."""
    rng = random.Random(3)
    pieces = [rng.randbytes(1000), rng.randbytes(700), rng.randbytes(1010)]
    sequence = ChunkSequence("k", b"H", total_bytes=1 + 2710)
    sent = [encode(sequence.chunk(b"", 0))]
    sent += [encode(sequence.chunk(p)) for p in pieces]
    sent.append(encode(sequence.end()))
    parts = [(c.data, c.crc32) for c in map(decode, sent) if c.data]
    out = list(split_parts(parts, key="k", header=b"H", chunk_bytes=1000))
    assert [c.seq for c in out] == [0, 1, 2, 3, 4]
    assert (out[0].key, out[0].header, out[0].total_bytes, bytes(out[0].data)) == (
        "k", b"H", 2711, b"",
    )  # fmt: skip
    assert all(encode(c) is message for c, message in zip(out[1:4], sent[1:4], strict=True))
    assert out[-1].last and not out[-1].data
    asm = ChunkAssembler()
    for c in out:
        asm.feed(decode(encode(c)))
    assert asm.finish() == b"".join(pieces)
