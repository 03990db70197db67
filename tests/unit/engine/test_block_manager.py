"""The block pool's bookkeeping: blocks are made as they are first handed out, in the order
a pool of ready-made blocks would hand them out."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


def seq(name: str, tokens: int, arrival: int) -> Sequence:
    return Sequence(name, list(range(1, tokens + 1)), PARAMS, arrival=arrival)


def test_blocks_are_made_when_first_handed_out_in_pool_order() -> None:
    bm = BlockManager(100_000, 4)
    assert bm.num_free_blocks == 100_000 and bm.blocks == []  # an idle pool holds none
    a = seq("a", 12, 0)
    assert bm.allocate(a, 12) and a.block_table == [0, 1, 2]
    assert len(bm.blocks) == 3 and bm.num_free_blocks == 99_997
    bm.check_consistency([a])
    bm.free(a)  # freed tail first: 2, 1, 0 are now the least recently freed, in that order
    assert bm.num_free_blocks == 100_000 and len(bm.blocks) == 3
    bm.check_consistency([])


def test_freed_blocks_come_after_the_never_used_ones_least_recently_freed_first() -> None:
    bm = BlockManager(6, 4)
    a = seq("a", 12, 0)
    assert bm.allocate(a, 12)
    bm.free(a)
    b = seq("b", 24, 1)
    assert bm.allocate(b, 24) and b.block_table == [3, 4, 5, 2, 1, 0]
    assert not bm.allocate(seq("c", 4, 2), 4) and bm.num_free_blocks == 0
    bm.check_consistency([b])
