"""The KV event index against the engine's own prefix cache, and its stream entry format."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockEvents, BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.scheduling.prefix_index import (
    PrefixIndex,
    PromptBlocks,
    _apply_entry,
    decode_events,
    encode_events,
)

BLOCK = 16


def computed(bm: BlockManager, request_id: str, tokens: list[int], salt: str = "") -> Sequence:
    """A sequence whose prompt the engine computed (its full blocks are in the cache)."""
    seq = Sequence(request_id, tokens, SamplingParams(), arrival=0, tenant=salt)
    assert bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.register_computed_blocks(seq)
    return seq


def engine_hits(bm: BlockManager, tokens: list[int], salt: str = "") -> int:
    """Prompt tokens the engine's prefix cache would serve to a new request."""
    probe = Sequence("probe", tokens, SamplingParams(), arrival=1, tenant=salt)
    return len(bm.match_prefix(probe)) * BLOCK


def test_the_index_counts_what_the_engine_would_reuse() -> None:
    bm = BlockManager(64, BLOCK)
    bm.events = BlockEvents()
    history = [16 + i % 300 for i in range(10 * BLOCK + 5)]
    computed(bm, "turn-1", history, salt="acme")
    index = PrefixIndex()
    index.apply("w1", b"epoch", BLOCK, bm.events.drain(), snapshot=True)

    follow_up = [*history, 7, 8, 9, *range(40, 80)]
    for salt, prompt in [("acme", follow_up), ("acme", history), ("other", follow_up),
                         ("acme", [5, *follow_up])]:  # fmt: skip
        blocks = PromptBlocks(prompt, salt)
        assert blocks.cached_tokens(index, "w1") == engine_hits(bm, prompt, salt), (
            salt,
            prompt[:3],
        )
    assert PromptBlocks(follow_up, "acme").cached_tokens(index, "w1") == 10 * BLOCK
    assert PromptBlocks(follow_up, "acme").cached_tokens(index, "unknown-worker") == 0


def test_evictions_leave_the_index() -> None:
    bm = BlockManager(4, BLOCK)
    bm.events = BlockEvents()
    first = [16 + i for i in range(3 * BLOCK)]
    seq = computed(bm, "a", first)
    index = PrefixIndex()
    index.apply("w", b"e", BLOCK, bm.events.drain())
    bm.free(seq)
    computed(bm, "b", [900 + i for i in range(3 * BLOCK)])  # reuses the cached blocks
    index.apply("w", b"e", BLOCK, bm.events.drain())
    blocks = PromptBlocks([*first, 1], "")
    hits = engine_hits(bm, [*first, 1])
    assert hits < 3 * BLOCK  # some of its blocks were overwritten
    assert blocks.cached_tokens(index, "w") == hits


def test_snapshots_and_new_epochs_replace_what_was_known() -> None:
    h = [bytes([i]) * 16 for i in range(4)]
    index = PrefixIndex()
    index.apply("w", b"one", BLOCK, [(True, h[0]), (True, h[1])])
    assert index.leading_blocks("w", h) == 2
    index.apply("w", b"one", BLOCK, [(True, h[2])], snapshot=True)
    assert index.leading_blocks("w", h) == 0 and index.size("w") == 1
    index.apply("w", b"two", BLOCK, [(True, h[0])])  # restarted: its old blocks are gone
    assert index.size("w") == 1 and index.leading_blocks("w", h) == 1
    index.forget(["other"])
    assert index.size("w") == 0 and index.block_size("w") is None


def test_stream_entries_round_trip_and_bad_ones_are_skipped() -> None:
    events = [(True, bytes([1]) * 16), (False, bytes([2]) * 16), (True, bytes([1]) * 16)]
    assert decode_events(encode_events(events)) == events
    index = PrefixIndex()
    fields = {b"w": b"w1", b"e": b"ep", b"b": b"16", b"x": encode_events(events)}
    _apply_entry(index, fields)
    assert index.size("w1") == 1 and index.entries == 1
    _apply_entry(index, {b"w": b"w2", b"x": b""})  # no block size: ignored
    assert index.size("w2") == 0 and index.entries == 1


def test_a_stores_blocks_add_up_over_publishers_and_count_for_workers_that_read_it() -> None:
    """Two workers publish what they put into one store (one epoch for all): the index holds
    the union, keeps it when heartbeats go, and a worker reading prefixes from that store may
    reuse the store's prefix or its own cache's, whichever is longer."""
    from pdserve.engine.block_manager import chain_block_hashes
    from pdserve.prefix.store_blocks import StoreBlocks
    from pdserve.scheduling.prefix_index import STORE_EPOCH, store_id

    prompt = list(range(5 * BLOCK + 1))
    h = chain_block_hashes(prompt[:-1], BLOCK, salt="t")
    store = "mooncake://m:1"
    a, b = StoreBlocks(store, BLOCK), StoreBlocks(store, BLOCK)
    a.stored(h[:2])
    b.stored(h[2:4])
    index = PrefixIndex()
    for log in (a, b):
        fields = {
            b"w": store_id(log.address).encode(), b"e": STORE_EPOCH,
            b"b": str(log.block_size).encode(), b"x": encode_events(log.drain()),
        }  # fmt: skip
        _apply_entry(index, fields)
    assert a.drain() == [] and index.leading_blocks(store_id(store), h) == 4
    index.apply("w1", b"e1", BLOCK, [(True, h[0])])
    index.forget(["w1"])  # heartbeats: the store is no worker and stays
    blocks = PromptBlocks(prompt, "t")
    assert blocks.cached_tokens(index, "w1") == BLOCK
    assert blocks.reusable_tokens(index, "w1", store) == 4 * BLOCK
    assert blocks.reusable_tokens(index, "w1", "") == BLOCK  # reads no store
    assert blocks.reusable_tokens(index, "w1", "other:1") == BLOCK
    assert PromptBlocks(prompt, "u").reusable_tokens(index, "w1", store) == 0  # other tenant
    index.apply(store_id(store), STORE_EPOCH, BLOCK, [(False, h[2])])  # a lookup missed it
    assert blocks.reusable_tokens(index, "w1", store) == 2 * BLOCK
