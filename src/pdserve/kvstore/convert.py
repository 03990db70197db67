"""The KVStore service's answers: ``PutOutcome`` -> ``PutResponse``; ``StoreStats`` and
``EntryStat`` <-> ``StatResponse`` (its totals carry the ``StoreStats`` fields by name).

The chunks of ``Put`` and ``Get`` have their own codec (``kvstore.wire``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pdserve.kvstore.entry import EntryStat
from pdserve.kvstore.stats import StoreStat, StoreStats
from pdserve.v1 import kvstore_pb2

if TYPE_CHECKING:  # the store's side only: a client decodes answers without loading the store
    from pdserve.kvstore.streams import PutOutcome

_TOTALS = tuple(f.name for f in dataclasses.fields(StoreStats))
"""The ``StatResponse`` fields of the store's totals: one per ``StoreStats`` field."""


def put_response(outcome: PutOutcome) -> kvstore_pb2.PutResponse:
    return kvstore_pb2.PutResponse(
        key=outcome.key,
        num_bytes=outcome.num_bytes,
        num_chunks=outcome.num_chunks,
        lease_s=outcome.lease_s,
    )


def store_stats_to_proto(stats: StoreStats) -> kvstore_pb2.StatResponse:
    """The answer to a ``Stat`` with no key: the store's totals."""
    return kvstore_pb2.StatResponse(exists=True, **{n: getattr(stats, n) for n in _TOTALS})


def entry_stat_to_proto(entry: EntryStat | None) -> kvstore_pb2.StatResponse:
    """The answer to a ``Stat`` of one key; None: absent or expired."""
    if entry is None:
        return kvstore_pb2.StatResponse(exists=False)
    return kvstore_pb2.StatResponse(
        exists=True,
        num_bytes=entry.num_bytes,
        lease_remaining_s=entry.lease_remaining_s,
        tier=entry.tier.value,
        refs=entry.refs,
    )


def store_stat_from_proto(msg: kvstore_pb2.StatResponse, *, totals: bool) -> StoreStat:
    """A ``Stat`` answer as the client reads it; ``totals``: it answered a ``Stat`` with no
    key (every total and counter in ``StoreStat.totals``)."""
    return StoreStat(
        msg.exists,
        msg.num_bytes,
        msg.lease_remaining_s,
        msg.used_bytes,
        msg.capacity_bytes,
        msg.num_entries,
        tier=msg.tier,
        refs=msg.refs,
        totals=StoreStats(**{n: getattr(msg, n) for n in _TOTALS}) if totals else None,
    )
