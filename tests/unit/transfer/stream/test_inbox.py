"""``Inbox``: ``direct`` hand-offs pushed into a decode worker, assembled as their chunks land
(through the real chunk codec), held by key until a ``LocalReceiver`` takes them or their
lease ends; malformed streams are refused naming the field, and nothing is left behind."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    KVPayloadMismatchError,
    KVTransferError,
    UnknownRequestError,
)
from pdserve.kvstore import wire
from pdserve.kvstore.chunks import ChunkSequence
from pdserve.kvstore.keys import handoff_key
from pdserve.kvstore.wire import Chunk
from pdserve.transfer.base import KVLocation, TransferState, TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.stream.frames import LayerCopy, stream_bytes
from pdserve.transfer.stream.header import StreamHeader
from pdserve.transfer.stream.inbox import Inbox, request_of_key
from pdserve.transfer.stream.receiver import LocalReceiver
from tests.unit.transfer.conftest import assert_same_payload, make_layout, random_payload

LAYOUT = make_layout(num_layers=4)
N = 19


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def key_of(rid: str) -> str:
    return handoff_key(rid, secrets.token_bytes(16))


def chunks_of(
    key: str,
    payload: KVPayload,
    *,
    rid: str = "r",
    piece_bytes: int = 200,
    corrupt: bool = False,
    lease_s: float = 0.0,
    header: bytes | None = None,
    total_bytes: int | None = None,
) -> list[Chunk]:
    """A Push stream of ``payload`` as the direct sender builds it, through the wire codec."""
    h = StreamHeader(rid, payload.layout, payload.num_tokens)
    sequence = ChunkSequence(
        key,
        h.encode() if header is None else header,
        lease_s,
        stream_bytes(h) if total_bytes is None else total_bytes,
    )
    chunks = [sequence.chunk(b"", 0)]
    for i in range(payload.layout.num_layers):
        copy = LayerCopy.take(i, payload.keys[i], payload.values[i])
        for piece in copy.seal(piece_bytes, Compression.NONE, corrupt=corrupt and i == 2):
            chunks.append(sequence.chunk(*piece))
    chunks.append(sequence.end())
    return [wire.decode(wire.encode(c)) for c in chunks]


async def feed(chunks: list[Chunk], *, fail_after: int | None = None) -> AsyncIterator[Chunk]:
    for i, chunk in enumerate(chunks):
        if fail_after is not None and i == fail_after:
            raise ConnectionError("the stream broke off")
        yield chunk


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=30))


def nothing_left(inbox: Inbox) -> bool:
    stats = inbox.stats()
    return (stats.num_entries, stats.num_writing, stats.used_bytes) == (0, 0, 0)


def test_a_pushed_hand_off_is_assembled_and_taken_once() -> None:
    payload = random_payload(LAYOUT, N)
    key = key_of("r")

    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT, default_lease_s=30)
        chunks = chunks_of(key, payload)
        got = await inbox.receive(feed(chunks))
        size = stream_bytes(StreamHeader("r", LAYOUT, N))
        assert (got.key, got.num_bytes, got.num_chunks, got.lease_s) == (
            key,
            size,
            len(chunks),
            30,
        )
        stats = inbox.stats()
        assert (stats.num_entries, stats.num_writing, stats.used_bytes) == (1, 0, size)
        location = KVLocation(TransportKind.DIRECT, "r", N, size, "fp", address="me:1", key=key)
        receiver = LocalReceiver(inbox, location, expected_layout=LAYOUT)
        assert_same_payload(await receiver.receive(5.0), payload)
        assert receiver.state is TransferState.DONE and receiver.record.num_bytes == size
        assert nothing_left(inbox)
        with pytest.raises(UnknownRequestError):
            inbox.take(key)

    run(body)


def test_a_bad_frame_fails_the_push_at_its_end_and_keeps_nothing() -> None:
    payload = random_payload(LAYOUT, N)

    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        chunks = chunks_of(key_of("r"), payload, corrupt=True)
        seen: list[int] = []

        async def counted() -> AsyncIterator[Chunk]:
            async for chunk in feed(chunks):
                seen.append(chunk.seq)
                yield chunk

        with pytest.raises(KVTransferError, match="checksum"):
            await inbox.receive(counted())
        assert len(seen) == len(chunks)  # read to its end, so that the reason reaches the sender
        assert nothing_left(inbox)

    run(body)


@pytest.mark.parametrize("where", ["first chunk", "mid-stream", "before the last chunk"])
def test_a_stream_that_breaks_off_leaves_nothing(where: str) -> None:
    payload = random_payload(LAYOUT, N)
    chunks = chunks_of(key_of("r"), payload)
    cut = {"first chunk": 1, "mid-stream": len(chunks) // 2, "before the last chunk": None}[where]

    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        if cut is None:  # the sender's stream ends without its last chunk
            with pytest.raises(KVTransferError, match="without the last one"):
                await inbox.receive(feed(chunks[:-1]))
        else:
            with pytest.raises(ConnectionError):
                await inbox.receive(feed(chunks, fail_after=cut))
        assert nothing_left(inbox)

    run(body)


def test_an_entry_no_decode_takes_is_dropped_after_its_lease() -> None:
    payload = random_payload(LAYOUT, N)
    key = key_of("r")

    async def body() -> None:
        clock = Clock()
        inbox = Inbox(1 << 20, expected_layout=LAYOUT, default_lease_s=60, clock=clock)
        await inbox.receive(feed(chunks_of(key, payload, lease_s=5)))
        clock.now += 4.9
        assert inbox.sweep() == 0 and inbox.stats().num_entries == 1
        clock.now += 0.2
        assert inbox.sweep() == 1 and nothing_left(inbox)
        with pytest.raises(UnknownRequestError):
            inbox.take(key)

    run(body)


def test_an_expired_entry_is_not_taken_even_before_the_sweep() -> None:
    payload = random_payload(LAYOUT, N)
    key = key_of("r")

    async def body() -> None:
        clock = Clock()
        inbox = Inbox(1 << 20, expected_layout=LAYOUT, default_lease_s=5, clock=clock)
        await inbox.receive(feed(chunks_of(key, payload)))
        clock.now += 5
        with pytest.raises(UnknownRequestError):
            inbox.take(key)
        assert nothing_left(inbox)

    run(body)


def test_drop_and_discard_free_an_entry_and_only_its_own_key() -> None:
    payload = random_payload(LAYOUT, N)
    key = key_of("r")

    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        await inbox.receive(feed(chunks_of(key, payload)))
        other = key_of("r")  # the same request, another capability
        assert not inbox.drop(other) and inbox.stats().num_entries == 1
        guessed = KVLocation(TransportKind.DIRECT, "r", N, 0, "fp", address="me:1", key=other)
        wrong = LocalReceiver(inbox, guessed, expected_layout=LAYOUT)
        with pytest.raises(UnknownRequestError):
            await wrong.receive(5.0)
        await wrong.discard()
        assert inbox.stats().num_entries == 1  # a wrong capability takes nothing
        location = KVLocation(TransportKind.DIRECT, "r", N, 0, "fp", address="me:1", key=key)
        await LocalReceiver(inbox, location).discard()  # a Decode call that failed early
        assert nothing_left(inbox)
        await inbox.receive(feed(chunks_of(key, payload)))
        assert inbox.drop(key) and not inbox.drop(key)
        assert nothing_left(inbox)

    run(body)


def test_a_push_that_cannot_fit_is_refused_at_its_first_chunk() -> None:
    payload = random_payload(LAYOUT, N)
    size = stream_bytes(StreamHeader("r", LAYOUT, N))

    async def body() -> None:
        inbox = Inbox(size + size // 2, expected_layout=LAYOUT)
        await inbox.receive(feed(chunks_of(key_of("r"), payload)))
        seen: list[int] = []

        async def counted() -> AsyncIterator[Chunk]:
            async for chunk in feed(chunks_of(key_of("r2"), payload, rid="r2")):
                seen.append(chunk.seq)
                yield chunk

        with pytest.raises(CapacityError, match="inbox full"):
            await inbox.receive(counted())
        assert seen == [0]
        assert inbox.stats().num_writing == 0 and inbox.stats().used_bytes == size

    run(body)


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("", "key"),
        ("blk/fp/16/abcd", "key"),
        ("kv/r", "key"),
        ("kv/r/0123", "key"),
        ("kv/r/" + "G" * 32, "key"),
        ("kv//" + "a" * 32, "key"),
    ],
)
def test_a_key_outside_the_hand_off_namespace_is_refused_naming_it(key: str, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        request_of_key(key)
    assert err.value.field == field

    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        with pytest.raises(InvalidArgumentError) as err:
            await inbox.receive(feed(chunks_of(key, random_payload(LAYOUT, N))))
        assert err.value.field == field and nothing_left(inbox)

    run(body)


@pytest.mark.parametrize(
    ("header", "rid", "field"),
    [
        (b"", "r", "header"),
        (b"PDKVS1\n{not json", "r", "header"),
        (b"something else", "r", "header"),
        (None, "someone-else", "header.request_id"),
    ],
)
def test_a_missing_or_garbled_header_is_refused_naming_it(
    header: bytes | None, rid: str, field: str
) -> None:
    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        chunks = chunks_of(key_of("r"), random_payload(LAYOUT, N), rid=rid, header=header)
        with pytest.raises(InvalidArgumentError) as err:
            await inbox.receive(feed(chunks))
        assert err.value.field == field and nothing_left(inbox)

    run(body)


def test_an_empty_stream_and_another_models_stream_are_refused() -> None:
    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        with pytest.raises(InvalidArgumentError) as err:
            await inbox.receive(feed([]))
        assert err.value.field == "key"
        other = random_payload(make_layout(num_layers=4, fingerprint="fp-b"), N)
        with pytest.raises(KVPayloadMismatchError):
            await inbox.receive(feed(chunks_of(key_of("r"), other)))
        assert nothing_left(inbox)

    run(body)


def test_a_stream_stalled_for_its_whole_lease_is_ended_by_the_sweep() -> None:
    payload = random_payload(LAYOUT, N)
    chunks = chunks_of(key_of("r"), payload, lease_s=5)

    async def body() -> None:
        clock = Clock()
        inbox = Inbox(1 << 20, expected_layout=LAYOUT, clock=clock)
        stalled = asyncio.Event()
        resume = asyncio.Event()

        async def stalling() -> AsyncIterator[Chunk]:
            for i, chunk in enumerate(chunks):
                if i == 3:
                    stalled.set()
                    await resume.wait()
                yield chunk

        task = asyncio.create_task(inbox.receive(stalling()))
        await stalled.wait()
        assert inbox.stats().num_writing == 1 and inbox.stats().used_bytes > 0
        clock.now += 5
        inbox.sweep()
        assert nothing_left(inbox)
        resume.set()
        with pytest.raises(KVTransferError, match="lease ran out"):
            await task
        assert nothing_left(inbox)

    run(body)
