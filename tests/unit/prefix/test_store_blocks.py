"""What ``PrefixReuse`` tells the scheduler's index about the KV store (``StoreBlocks``),
against a real Mooncake Store: the blocks of each chunk it puts, as stored; the blocks of the
first chunk a lookup misses, as removed; nothing for another tenant's prompt. Skipped, with
the reason, where the Mooncake package cannot load."""

from __future__ import annotations

import asyncio

import torch

from pdserve.engine.block_manager import chain_block_hashes
from pdserve.kvstore.mooncake.client import MooncakeStoreClient
from pdserve.kvstore.mooncake.master import MasterProcess
from pdserve.prefix.store import PrefixReuse
from pdserve.prefix.store_blocks import StoreBlocks
from tests.unit.transfer.conftest import make_layout

CHUNK = 32


def test_puts_log_stored_blocks_and_a_miss_logs_the_first_missing_chunk(
    mooncake_master: MasterProcess,
) -> None:
    layout = make_layout(num_layers=2)
    prompt = list(range(100, 100 + 3 * CHUNK + 4))  # three whole chunks and a tail
    hashes = chain_block_hashes(prompt[: 3 * CHUNK], layout.block_size, salt="t")
    per = CHUNK // layout.block_size

    async def body() -> None:
        async with MooncakeStoreClient(
            mooncake_master.address(segment="16MiB"), timeout_s=5
        ) as client:
            log = StoreBlocks(client.address, layout.block_size)
            reuse = PrefixReuse(client, layout, chunk_tokens=CHUNK, store_blocks=log)
            # Nothing stored: the miss names chunk 0's blocks (no engine is needed for it).
            assert await reuse.seed(None, "r0", prompt, "t") == 0  # type: ignore[arg-type]
            assert log.drain() == [(False, h) for h in hashes[:per]]
            # The prompt computed: its chunks go in, their blocks logged as stored.
            publisher = reuse.publisher(prompt, "t", first=0)
            assert publisher is not None
            shape = (len(prompt), layout.num_kv_heads, layout.head_dim)
            for layer in range(layout.num_layers):
                publisher(layer, torch.randn(shape), torch.randn(shape))
            reuse.publish(publisher)
            await reuse.close()
            assert log.drain() == [(True, h) for h in hashes]
            keys = reuse.keys(prompt, "t")
            assert await client.lookup(keys) == 3
            # Evicted (here: removed): the next lookup misses chunk 0 and names its blocks.
            for key in keys:
                assert await client.delete(key)
            await reuse.seed(None, "r1", prompt, "t")  # type: ignore[arg-type]
            assert log.drain() == [(False, h) for h in hashes[:per]]
            # Another tenant's prompt hashes differently: nothing of tenant t's is named.
            await reuse.seed(None, "r2", prompt, "u")  # type: ignore[arg-type]
            assert not {h for _, h in log.drain()} & set(hashes)

    asyncio.run(asyncio.wait_for(body(), timeout=60))
    assert mooncake_master.key_count() == 0
