"""``BandwidthMeter``: averages and 100 ms peaks worked out by hand from explicit stamps."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.bandwidth import SAME_HOST, BandwidthMeter, LinkRate
from pdserve.transfer.record import HandoffRecord

S = 1_000_000_000
MS = 1_000_000


class Clock:
    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


def test_a_burst_in_an_idle_window_peaks_at_its_own_rate() -> None:
    clock = Clock(20 * S)
    meter = BandwidthMeter(clock)
    # 50 MB in 50 ms, inside the bucket [15.0 s, 15.1 s): 50 MB over 10 s is 5 MB/s on
    # average; the bucket holds all 50 MB, i.e. 500 MB/s over its 100 ms.
    meter.record("decode-1", "direct", 50_000_000, 15 * S, 15 * S + 50 * MS)
    (rate,) = meter.rates()
    assert (rate.link, rate.transport) == ("decode-1", "direct")
    assert (rate.average_bps, rate.peak_bps) == (pytest.approx(5e6), 500e6)
    assert meter.totals() == (pytest.approx(5e6), pytest.approx(500e6))


def test_a_transfer_is_spread_evenly_over_the_buckets_it_spans() -> None:
    meter = BandwidthMeter(Clock(20 * S))
    # 30 MB over 300 ms from 15.05 s: 10 MB per 100 ms, so buckets [15.0, 15.1) and
    # [15.3, 15.4) hold 5 MB each, the two between them 10 MB each: peak 100 MB/s.
    meter.record("b", "store", 30_000_000, 15 * S + 50 * MS, 15 * S + 350 * MS)
    (rate,) = meter.rates()
    assert rate.peak_bps == pytest.approx(100e6)
    assert rate.average_bps == pytest.approx(3e6)


def test_overlapping_transfers_add_up_in_the_shared_bucket() -> None:
    meter = BandwidthMeter(Clock(20 * S))
    # A: 20 MB over [15.0, 15.2) -> 10 MB in each of its buckets.
    # B: 6 MB over [15.1, 15.13) -> all in bucket [15.1, 15.2). That bucket: 16 MB.
    meter.record("b", "direct", 20_000_000, 15 * S, 15 * S + 200 * MS)
    meter.record("b", "direct", 6_000_000, 15 * S + 100 * MS, 15 * S + 130 * MS)
    (rate,) = meter.rates()
    assert rate.peak_bps == pytest.approx(160e6)
    assert rate.average_bps == pytest.approx(2.6e6)


def test_links_are_kept_apart_and_totals_add_them_per_bucket() -> None:
    meter = BandwidthMeter(Clock(20 * S))
    meter.record("a", "direct", 10_000_000, 15 * S, 15 * S + 10 * MS)
    meter.record("b", "direct", 4_000_000, 15 * S + 50 * MS, 15 * S + 60 * MS)
    meter.record("b", "direct", 30_000_000, 16 * S, 16 * S + 10 * MS)
    a, b = meter.rates()
    assert (a.link, a.peak_bps, b.link, b.peak_bps) == ("a", 100e6, "b", pytest.approx(300e6))
    # Bucket [15.0, 15.1) carries 14 MB of both links, [16.0, 16.1) 30 MB of b alone.
    assert meter.totals() == (pytest.approx(4.4e6), pytest.approx(300e6))


def test_bytes_expire_after_ten_seconds() -> None:
    clock = Clock(20 * S)
    meter = BandwidthMeter(clock)
    meter.record("b", "direct", 10_000_000, 15 * S, 15 * S + 10 * MS)
    clock.now_ns = 25 * S + 99 * MS  # the window is [15.1 s, 25.2 s): the bucket is gone
    assert meter.rates() == (LinkRate("b", "direct", 0.0, 0.0),)
    # A transfer recorded late, half of it already out of the window: only the live half.
    meter.record("b", "direct", 20_000_000, 15 * S, 15 * S + 200 * MS)
    (rate,) = meter.rates()
    assert rate.average_bps == pytest.approx(1e6)
    # The slot of an expired bucket starts again from zero when reused.
    meter.record("b", "direct", 1_000_000, 25 * S, 25 * S + 10 * MS)  # slot of 15.0 s
    (rate,) = meter.rates()
    assert rate.average_bps == pytest.approx(1.1e6)
    assert rate.peak_bps == pytest.approx(100e6)


def test_a_handoff_record_counts_the_receivers_read_else_the_senders_transfer() -> None:
    meter = BandwidthMeter(Clock(20 * S))
    sent = HandoffRecord(
        "direct", 8_000_000, send_start_ns=14 * S, first_layer_ns=15 * S,
        send_end_ns=15 * S + 80 * MS,
    )  # fmt: skip
    got = HandoffRecord("shm", 2_000_000, recv_start_ns=16 * S, recv_end_ns=16 * S + 20 * MS)
    meter.record_handoff("decode-host", sent)
    meter.record_handoff("prefill-host", got)
    meter.record_handoff("x", HandoffRecord("recompute"))  # nothing moved: left out
    direct, shm = meter.rates()  # sorted by link
    assert (shm.link, shm.peak_bps) == (SAME_HOST, pytest.approx(20e6))
    assert (direct.link, direct.peak_bps) == ("decode-host", pytest.approx(80e6))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", "direct", 1, 0, 1), "link"),
        (("a", "", 1, 0, 1), "transport"),
        (("a", "direct", -1, 0, 1), "num_bytes"),
        (("a", "direct", 1, 5, 4), "end_ns"),
    ],
)
def test_bad_input_names_the_field(args: tuple[str, str, int, int, int], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        BandwidthMeter(Clock(0)).record(*args)
