"""The KVStore service's answers (``kvstore.convert``): totals and a key's stat through
``StatResponse`` and back, and the Put outcome."""

from __future__ import annotations

import dataclasses

from pdserve.kvstore import convert
from pdserve.kvstore.entry import EntryStat, Tier
from pdserve.kvstore.stats import StoreStats
from pdserve.kvstore.streams import PutOutcome


def test_totals_round_trip_field_by_field() -> None:
    # Every field a distinct value, so a field dropped or swapped on the way shows.
    values = {f.name: i + 1 for i, f in enumerate(dataclasses.fields(StoreStats))}
    values["uptime_s"] = 12.5
    stats = StoreStats(**values)
    msg = convert.store_stats_to_proto(stats)
    assert msg.exists
    back = convert.store_stat_from_proto(msg, totals=True)
    assert back.totals == stats
    assert (back.used_bytes, back.capacity_bytes, back.num_entries) == (
        stats.used_bytes,
        stats.capacity_bytes,
        stats.num_entries,
    )


def test_a_keys_stat_round_trips_without_totals() -> None:
    msg = convert.entry_stat_to_proto(EntryStat(300, 4.5, Tier.DISK, 2))
    back = convert.store_stat_from_proto(msg, totals=False)
    assert back.exists and back.totals is None
    assert (back.num_bytes, back.lease_remaining_s, back.tier, back.refs) == (300, 4.5, "disk", 2)
    absent = convert.store_stat_from_proto(convert.entry_stat_to_proto(None), totals=False)
    assert not absent.exists and absent.num_bytes == 0


def test_put_response_carries_the_outcome() -> None:
    msg = convert.put_response(PutOutcome("kv/r/00", 10, 2, 60.0))
    assert (msg.key, msg.num_bytes, msg.num_chunks, msg.lease_s) == ("kv/r/00", 10, 2, 60.0)
