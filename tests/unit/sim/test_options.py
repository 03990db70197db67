"""What a sim worker is told (``SimOptions``): its checks, the time a modelled hand-off
takes, and the links its heartbeats publish for the scheduler's cost model."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.sim.backend import SimOptions
from pdserve.sim.shapes import MODELS
from pdserve.transfer.base import TransportKind
from pdserve.transfer.links import Links


def test_a_hand_off_takes_the_modelled_link_s_time_stretched_by_the_scale() -> None:
    opts = SimOptions.parse("roofline:h100:llama-3-8b", time_scale=4.0, link="tcp-25")
    nbytes = 1000 * MODELS["llama-3-8b"].kv_bytes_per_token  # 131 MB of KV
    assert opts.transfer_s(1000) == pytest.approx(4.0 * (50e-6 + nbytes / (25e9 / 8 * 0.8)))
    assert opts.transfer_s(0) == 0.0


def test_heartbeats_publish_the_modelled_link_in_real_time() -> None:
    opts = SimOptions.parse("roofline:h100:llama-3-8b", time_scale=4.0, link="rdma-400")
    links = opts.links("node-a")
    published = dict(((peer, kind), rate) for peer, kind, rate in links.published())
    assert published == {("node-a", "shm"): 45e9 / 4, ("node-a", "direct"): 45e9 / 4}
    # The link model's estimate of a hand-off over them (the worker's, and the scheduler's
    # from the heartbeat) is then what the decode worker waits, to within the latency (the
    # link model's, not the modelled one: heartbeats publish bandwidths only).
    nbytes = 1000 * MODELS["llama-3-8b"].kv_bytes_per_token
    estimate = Links("node-a", links.published()).link("node-a", TransportKind.SHM)
    assert estimate.transfer_time_s(nbytes) == pytest.approx(opts.transfer_s(1000), abs=1e-3)
    # What moving the stand-in payload measures does not move a modelled link.
    links.measure("node-a", TransportKind.SHM, 1000, 1.0)
    assert dict(((peer, kind), rate) for peer, kind, rate in links.published()) == published


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("roofline:h100:llama-3-8b", 0.0), "--sim-time-scale"),
        (("roofline:h100:llama-3-8b", float("nan")), "--sim-time-scale"),
        (("roofline:h100:llama-3-8b", 1.0, "carrier-pigeon"), "--sim-link"),
        (("nonsense",), "--sim-profile"),
    ],
)
def test_bad_values_are_refused_naming_their_flag(args: tuple[object, ...], flag: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        SimOptions.parse(*args)  # type: ignore[arg-type]
    assert err.value.field == flag
