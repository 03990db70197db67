"""Reading an shm segment while its writer fills it (``shm_follow``, a prefetch)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import KVTransferError
from pdserve.transfer.shm import ShmReceiver, ShmSender
from tests.unit.transfer.conftest import (
    assert_same_payload,
    leftovers,
    make_layout,
    random_payload,
)

LAYERS = 4


def _payload(num_tokens: int = 9) -> KVPayload:
    return random_payload(make_layout(num_layers=LAYERS), num_tokens)


@pytest.mark.parametrize("threads", [0, 1])
def test_the_reader_follows_the_writer_to_a_verified_payload(shm_prefix: str, threads: int) -> None:
    """The read starts right after ``begin`` and ends once the segment is sealed."""
    payload = _payload()

    async def body() -> None:
        pool = ThreadPoolExecutor(1) if threads else None
        sender = ShmSender(prefix=shm_prefix)
        sender.begin("r", payload.layout, payload.num_tokens)
        receiver = ShmReceiver(follow=True, pool=pool)
        reading = asyncio.create_task(receiver.receive(sender.planned(), 30.0))
        for i in range(LAYERS):
            sender.send_layer(i, payload.keys[i], payload.values[i])
        sender.finish()
        got = await reading
        assert_same_payload(got, payload)
        assert leftovers(shm_prefix) == []  # the reader unlinked it at the seal
        if pool is not None:
            pool.shutdown()

    asyncio.run(body())


def test_a_writer_that_gives_up_ends_the_read(shm_prefix: str) -> None:
    payload = _payload()

    async def body() -> None:
        sender = ShmSender(prefix=shm_prefix)
        sender.begin("r", payload.layout, payload.num_tokens)
        receiver = ShmReceiver(follow=True)
        reading = asyncio.create_task(receiver.receive(sender.planned(), 30.0))
        sender.send_layer(0, payload.keys[0], payload.values[0])
        sender.abort()
        with pytest.raises(KVTransferError, match=r"gave up|gone"):
            await reading
        receiver.cleanup()
        assert leftovers(shm_prefix) == []

    asyncio.run(body())


def test_cleanup_stops_a_reader_still_waiting(shm_prefix: str) -> None:
    payload = _payload()

    async def body() -> None:
        sender = ShmSender(prefix=shm_prefix)
        sender.begin("r", payload.layout, payload.num_tokens)
        receiver = ShmReceiver(follow=True)
        reading = asyncio.create_task(receiver.receive(sender.planned(), 30.0))
        receiver.cleanup()  # before or while it waits for layer 0: it ends either way
        with pytest.raises(KVTransferError, match=r"cancelled|gone"):
            await reading
        sender.abort()
        assert leftovers(shm_prefix) == []

    asyncio.run(body())


def test_a_layer_changed_after_its_hash_fails_the_follow_read(shm_prefix: str) -> None:
    payload = _payload()

    def flip(data: np.ndarray) -> None:
        data[-1] ^= 0xFF

    async def body() -> None:
        sender = ShmSender(prefix=shm_prefix)
        sender.tamper = flip
        sender.begin("r", payload.layout, payload.num_tokens)
        receiver = ShmReceiver(follow=True)
        reading = asyncio.create_task(receiver.receive(sender.planned(), 30.0))
        for i in range(LAYERS):
            sender.send_layer(i, payload.keys[i], payload.values[i])
        sender.finish()
        with pytest.raises(KVTransferError, match="layer 0 failed its checksum"):
            await reading
        receiver.cleanup()
        assert leftovers(shm_prefix) == []

    asyncio.run(body())
