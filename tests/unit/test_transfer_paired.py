"""Paired bandwidth rounds of ``pdserve bench transfer``: each hand-off is bracketed by its
own reference, and a point's ratio is the median over its rounds."""

from __future__ import annotations

import asyncio

from pdserve_bench.transfer_paired import Pair, rounds, summarize
from pdserve_bench.transfer_sample import Sample

GB = 1e9


def _sample(transport: str, send: float, recv: float, tokens: int = 100) -> Sample:
    """A deferred hand-off of 1 GB: ``send`` and ``recv`` in GB/s."""
    return Sample(
        transport, False, tokens, int(GB), 0.0, 0.0, 0.0, 0.0, send * GB,
        1e3 / recv, recv * GB, 0.0, 0, int(1e9 / send), 0, 0,
    )  # fmt: skip


def test_a_pair_is_the_slower_side_over_the_mean_of_its_bracket() -> None:
    store = Pair.of(_sample("store", 2.0, 1.0), (3 * GB, 1.5 * GB), (1 * GB, 0.5 * GB))
    assert store.bytes_per_s == 1.0 * GB  # recv is the slower side
    assert store.ratio == 0.5  # 1 GB/s over the mean of 3 and 1
    assert store.grpc_ratio == 1.0
    direct = Pair.of(_sample("direct", 2.0, 1.0), (4 * GB, GB), (4 * GB, GB))
    assert direct.ratio == 0.5  # direct: the send (its read hands over what arrived)
    shm = Pair.of(_sample("shm", 5.0, 10.0), (10 * GB, 0.0), (10 * GB, 0.0))
    assert shm.ratio == 0.5 and shm.grpc_ratio is None


def test_a_point_is_the_median_of_its_rounds_with_the_range() -> None:
    pairs = [
        Pair("store", 8, 1, rate, rate, ref, ref)
        for rate, ref in ((1.0, 4.0), (1.0, 2.0), (3.0, 4.0), (1.0, 1.0), (2.0, 4.0))
    ]
    pairs.append(Pair("shm", 8, 1, 5.0, 5.0, 10.0, 10.0))
    points = summarize(pairs)
    store = points["store", 8]
    assert store.rounds == 5
    assert store.ratio == 0.5  # of 0.25, 0.5, 0.75, 1.0, 0.5
    assert (store.ratio_low, store.ratio_high) == (0.25, 1.0)
    assert store.ratio_text == "50% (25%-100%)"
    assert store.send_bytes_per_s == 1.0
    assert points["shm", 8].rounds == 1


def test_rounds_bracket_every_hand_off_with_its_own_reference() -> None:
    events: list[str] = []
    rates = iter([4.0, 2.0, 1.0, 3.0, 5.0, 6.0, 2.0, 2.0])  # TCP, then memcpy, alternately

    def reference(transport: str) -> tuple[float, float]:
        events.append(f"ref {transport}")
        return next(rates) * GB, (GB if transport != "shm" else 0.0)

    async def hand_off(transport: str) -> Sample:
        events.append(f"send {transport}")
        return _sample(transport, 1.5, 1.5)

    pairs = asyncio.run(rounds(hand_off, ["store", "shm"], 2, reference))
    assert events == ["ref store", "send store", "ref store", "ref shm", "send shm", "ref shm"] * 2
    assert [p.transport for p in pairs] == ["store", "shm", "store", "shm"]
    assert [(p.before / GB, p.after / GB) for p in pairs] == [(4, 2), (1, 3), (5, 6), (2, 2)]
    assert pairs[0].ratio == 0.5 and pairs[0].grpc_ratio == 1.5


def test_a_points_cpu_per_gb_is_its_rounds_cpu_over_their_bytes() -> None:
    readings = iter([10.0, 10.5, 11.0, 12.5])  # CPU seconds before and after each hand-off

    def reference(transport: str) -> tuple[float, float]:
        return GB, GB

    async def hand_off(transport: str) -> Sample:
        return _sample(transport, 1.0, 1.0)  # 1 GB each

    pairs = asyncio.run(rounds(hand_off, ["nixl"], 2, reference, cpu=lambda: next(readings)))
    assert [p.cpu_s for p in pairs] == [0.5, 1.5]
    assert summarize(pairs)["nixl", 100].cpu_s_per_gb == 1.0  # 2 s over 2 GB
    # Each 1 GB hand-off's first byte left at 0 and its send ended at 1 s (1 GB/s).
    assert [p.latency_ms for p in pairs] == [1000.0, 1000.0]
    assert summarize(pairs)["nixl", 100].latency_ms == (1000.0, 1000.0)
    unmetered = asyncio.run(rounds(hand_off, ["nixl"], 1, reference))
    assert unmetered[0].cpu_s == -1.0 and summarize(unmetered)["nixl", 100].cpu_s_per_gb is None
