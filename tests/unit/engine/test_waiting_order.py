"""The engine scheduler's waiting order, and the block manager's prefix-cache event log.

Pure bookkeeping (``Scheduler`` and ``BlockManager`` hold no tensors): no model is loaded.
"""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockEvents, BlockManager, chain_block_hashes
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.errors import InvalidArgumentError

BLOCK = 16


def make_scheduler(order: str, *, budget: int = 4096, aging: float = 2000.0) -> Scheduler:
    config = EngineConfig(
        block_size=BLOCK,
        num_kv_blocks=1024,
        max_num_batched_tokens=budget,
        waiting_order=order,  # type: ignore[arg-type]
        aging_tokens_per_s=aging,
    )
    return Scheduler(config, BlockManager(1024, BLOCK), max_model_len=8192)


def seq(request_id: str, n: int, arrival: int) -> Sequence:
    tokens = [16 + (arrival * 7 + i) % 900 for i in range(n)]
    return Sequence(request_id, tokens, SamplingParams(max_tokens=4), arrival=arrival)


def admitted_order(scheduler: Scheduler) -> list[str]:
    """The request ids of the prefill chunks of one step, in the order they were admitted."""
    return [c.seq.request_id for c in scheduler.schedule().prefills]


def test_fcfs_admits_in_arrival_order_and_a_short_prompt_waits_behind_long_ones() -> None:
    s = make_scheduler("fcfs", budget=2048)
    for i, (rid, n) in enumerate([("long-1", 2000), ("long-2", 2000), ("short", 50)]):
        s.add(seq(rid, n, i))
    order = admitted_order(s)
    # The budget goes to the long prompts (the second gets a chunk); the short one waits.
    assert order[0] == "long-1" and "short" not in order


def test_short_first_admits_the_short_prompt_before_long_ones() -> None:
    s = make_scheduler("short_first", budget=2048)
    for i, (rid, n) in enumerate([("long-1", 2000), ("long-2", 2000), ("short", 50)]):
        s.add(seq(rid, n, i))
    assert admitted_order(s)[0] == "short"


def test_short_first_ages_a_long_wait_ahead_of_a_fresh_short_prompt() -> None:
    s = make_scheduler("short_first", budget=2048, aging=1000.0)
    old = seq("old-long", 1500, 0)
    s.add(old)
    old.enqueued_at -= 2.0  # it has waited 2 s: 1500 - 2 * 1000 < 50
    s.add(seq("fresh-short", 50, 1))
    assert admitted_order(s)[0] == "old-long"


def test_waiting_order_is_validated() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        EngineConfig(waiting_order="lifo")  # type: ignore[arg-type]
    assert err.value.field == "waiting_order"
    with pytest.raises(InvalidArgumentError) as err:
        EngineConfig(aging_tokens_per_s=0)
    assert err.value.field == "aging_tokens_per_s"


def test_block_events_log_stores_and_evictions_in_order() -> None:
    bm = BlockManager(4, BLOCK)
    events = BlockEvents()
    bm.events = events
    a = seq("a", 3 * BLOCK + 1, 0)
    assert bm.allocate(a, len(a))
    a.num_computed_tokens = len(a)
    bm.register_computed_blocks(a)
    stored = chain_block_hashes(a.token_ids, BLOCK)
    assert events.drain() == [(True, h) for h in stored]
    assert sorted(bm.cached_hashes()) == sorted(stored)
    bm.free(a)
    b = seq("b", 2 * BLOCK, 5)  # needs 2 blocks: one never used, then the LRU cached one
    assert bm.allocate(b, len(b))
    drained = events.drain()
    assert len(drained) == 1 and drained[0][0] is False and drained[0][1] in stored
    assert events.drain() == []


def test_block_events_overflow_and_reset() -> None:
    events = BlockEvents(capacity=2)
    for i in range(3):
        events.record(True, bytes([i]) * 16)
    assert events.overflowed
    events.reset()
    assert not events.overflowed and events.drain() == []
