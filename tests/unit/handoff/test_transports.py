"""The real transports the connectors build on their own resources: chosen by kind (a fresh
sender per hand-off, a ``direct`` hand-off taken from this worker's inbox whoever it names),
and an shm hand-off between them through their copy and hash threads."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from pdserve.backends import TORCH, recompute_kv
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.request import EngineRequest
from pdserve.errors import InvalidArgumentError
from pdserve.handoff import DecodeConnector, HandoffPlan, PrefillConnector
from pdserve.kvstore.client import KVStoreClient
from pdserve.transfer.base import KVLocation, TransportKind
from pdserve.transfer.janitor import SHM_DIR
from pdserve.transfer.shm.handoff import ShmReceiver, ShmSender
from pdserve.transfer.stream.inbox import Inbox
from pdserve.transfer.stream.receiver import LocalReceiver, StreamReceiver
from pdserve.transfer.stream.sender import StreamSender
from tests.unit.backends.conftest import open_backend, run
from tests.unit.handoff.test_connectors import ONE, PROMPT
from tests.unit.transfer.conftest import assert_same_payload

SHM, STORE, DIRECT = TransportKind.SHM, TransportKind.STORE, TransportKind.DIRECT


def test_the_connectors_choose_their_transports_by_kind(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            store = KVStoreClient("store:1")
            prefill = PrefillConnector(engine, store, host="h1")
            inbox = Inbox(1024)
            decode = DecodeConnector(engine, inbox=inbox, host="h1")
            try:
                sending = prefill.transports
                shm = sending.sender(SHM)
                assert isinstance(shm, ShmSender) and shm.writer.host == "h1"
                again = sending.sender(SHM)
                assert again is not shm  # one per hand-off, on the connector's copy threads
                assert shm.writer.pool is not None and again.writer.pool is shm.writer.pool
                to_store = sending.sender(STORE, "peer:2")
                assert isinstance(to_store, StreamSender) and to_store.client is store
                direct = sending.sender(DIRECT, "peer:2")
                assert isinstance(direct, StreamSender)
                assert direct.client is prefill.peers.push("peer:2")

                receiving = decode.transports
                at = KVLocation(DIRECT, "r", 1, 0, "fp", key="k")
                # A direct hand-off is taken from this worker's inbox by its key, whoever it
                # names.
                for address in ("me:3", "peer:2"):
                    local = receiving.receiver(dataclasses.replace(at, address=address))
                    assert isinstance(local, LocalReceiver) and local.inbox is inbox
                stored = receiving.receiver(
                    dataclasses.replace(at, kind=STORE, address="store:1"), follow=True
                )
                assert isinstance(stored, StreamReceiver) and stored.follow
                assert stored.client.address == "store:1"
                with pytest.raises(InvalidArgumentError) as err:
                    receiving.receiver(at)  # no address
                assert err.value.field == "kv.direct.address"
                shm_in = receiving.receiver(dataclasses.replace(at, kind=SHM, host="h1"))
                assert isinstance(shm_in, ShmReceiver) and shm_in.reader.host == "h1"
                assert shm_in.reader.pool is not None
            finally:
                await prefill.close()
                await decode.close()
                await store.close()

    run(body)


def test_an_shm_hand_off_between_the_connectors(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            store = KVStoreClient("127.0.0.1:1", timeout_s=1)  # never dialled
            prefill = PrefillConnector(engine, store, host="h1")
            decode = DecodeConnector(engine, host="h1")
            try:
                kv = await recompute_kv(engine, EngineRequest("ref", PROMPT, ONE))
                async with prefill.open(
                    HandoffPlan("r", len(PROMPT), SHM, decode_host="h1")
                ) as out:
                    hook = out.layer_hook
                    assert hook is not None
                    for i in range(kv.layout.num_layers):
                        hook(i, kv.keys[i], kv.values[i])
                    sent = await out.hand_over(time.monotonic_ns())
                assert sent.location.kind is SHM and sent.location.host == "h1"
                async with decode.incoming(sent.location) as incoming:
                    arrival = await incoming.arrive(EngineRequest("r", PROMPT, ONE))
                assert arrival.record.transport == "shm" and not arrival.record.fallback_reason
                assert isinstance(arrival.payload, KVPayload)
                assert_same_payload(arrival.payload, kv)
                assert not (SHM_DIR / sent.location.key).exists()  # the reader unlinked it
            finally:
                await prefill.close()
                await decode.close()
                await store.close()

    run(body)
