"""KV transfer times over the modelled links."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.sim.links import LINK_NAMES, LINKS, parse_link
from pdserve.transfer.links import Link


def test_link_table() -> None:
    assert LINK_NAMES == ("nvlink", "rdma-400", "rdma-200", "tcp-25", "same-host")
    expected = {
        "nvlink": (450e9, 5e-6),
        "rdma-400": (45e9, 10e-6),
        "rdma-200": (22.5e9, 10e-6),
        "tcp-25": (2.5e9, 50e-6),
        "same-host": (20e9, 20e-6),
    }
    for name, (bandwidth, latency) in expected.items():
        assert LINKS[name] == Link(pytest.approx(bandwidth), latency)


def test_transfer_times() -> None:
    # 1 GiB of KV: about 8k tokens of llama-3-8b
    gib = 2**30
    assert parse_link("nvlink").transfer_time_s(gib) == pytest.approx(5e-6 + gib / 450e9)
    assert parse_link("rdma-400").transfer_time_s(gib) == pytest.approx(10e-6 + gib / 45e9)
    assert parse_link("tcp-25").transfer_time_s(gib) == pytest.approx(50e-6 + gib / 2.5e9)
    assert parse_link("TCP-25").transfer_time_s(1) == pytest.approx(50e-6 + 1 / 2.5e9)


def test_zero_bytes_cost_nothing_negative_refused() -> None:
    link = parse_link("same-host")
    assert link.transfer_time_s(0) == 0.0
    with pytest.raises(ValueError):
        link.transfer_time_s(-1)


def test_unknown_link_refused_listing_choices() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        parse_link("carrier-pigeon")
    assert e.value.field == "--sim-link"
    assert "carrier-pigeon" in str(e.value)
    for name in LINK_NAMES:
        assert name in str(e.value)
    with pytest.raises(InvalidArgumentError) as e:
        parse_link("", flag="--link")
    assert e.value.field == "--link"
