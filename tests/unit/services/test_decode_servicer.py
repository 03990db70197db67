"""``Decode.CachedPrefix`` served by the Decode servicer over a real decode worker (the tiny
checkpoint), on an in-process server: the prefill side's client gets the engine's answer, and
a malformed query is refused with INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

from pdserve.backends import TORCH
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import KVTransferError
from pdserve.handoff import DecodeConnector
from pdserve.handoff.peers import DecodePeers
from pdserve.prefix import decode as decode_prefix
from pdserve.rpc.server import build_server
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from pdserve.worker.decode import DecodeWorker
from services.decode.servicer import DecodeServicer
from tests.unit.backends.conftest import open_backend, run

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def test_cached_prefix_answers_from_the_engine_and_checks_its_fields(
    tiny_llama_dir: Path,
) -> None:
    prompt = [(7 * i + 3) % 1000 for i in range(41)]

    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            worker = DecodeWorker(engine, DecodeConnector(engine, host="h"))
            server, port, _ = build_server(
                [(decode_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(worker))], port=0
            )
            await server.start()
            clients = DecodePeers(timeout_s=10)
            address = f"127.0.0.1:{port}"
            try:
                async for _ in engine.generate(EngineRequest("warm", prompt, ONE, tenant="t")):
                    pass  # this worker ran the prompt before: its blocks are cached
                layout = engine.layout
                bs = layout.block_size
                whole = (len(prompt) - 1) // bs
                assert whole > 0
                query = decode_prefix.prefix_query(layout, prompt, "t")
                assert await clients.cached_prefix(address, query) == whole
                other = decode_prefix.prefix_query(layout, prompt, "u")
                assert await clients.cached_prefix(address, other) == 0  # another tenant
                foreign = dataclasses.replace(query, kv_fingerprint="another model")
                assert await clients.cached_prefix(address, foreign) == 0
                assert await decode_prefix.ask(clients, address, layout, prompt, "t") == whole * bs

                good = dict(kv_fingerprint="f", block_size=bs, block_hashes=[b"\0" * 16])
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = decode_pb2_grpc.DecodeStub(channel)
                    for field, bad in (
                        ("kv_fingerprint", {"kv_fingerprint": ""}),
                        ("block_size", {"block_size": 0}),
                        ("block_hashes[1]", {"block_hashes": [b"\0" * 16, b"\0" * 3]}),
                    ):
                        with pytest.raises(grpc.aio.AioRpcError) as caught:
                            await stub.CachedPrefix(
                                decode_pb2.CachedPrefixRequest(**{**good, **bad}), timeout=10
                            )
                        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                        assert field in (caught.value.details() or "")
            finally:
                await clients.close()
                await server.stop(None)
                await worker.close()
            # A worker that is gone: the query fails typed, and ``ask`` moves the whole prompt.
            gone = DecodePeers(timeout_s=2)
            try:
                with pytest.raises(KVTransferError):
                    await gone.cached_prefix(address, query)
                assert await decode_prefix.ask(gone, address, layout, prompt, "t") == 0
            finally:
                await gone.close()

    run(body)
