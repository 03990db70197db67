"""What a sim worker is told (``SimOptions``): its checks, the time a modelled hand-off
takes, and the links its heartbeats publish for the scheduler's cost model."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.sim.backend import SimOptions
from pdserve.sim.shapes import MODELS


def test_a_hand_off_takes_the_modelled_link_s_time_stretched_by_the_scale() -> None:
    opts = SimOptions.parse("roofline:h100:llama-3-8b", time_scale=4.0, link="tcp-25")
    nbytes = 1000 * MODELS["llama-3-8b"].kv_bytes_per_token  # 131 MB of KV
    assert opts.transfer_s(1000) == pytest.approx(4.0 * (50e-6 + nbytes / (25e9 / 8 * 0.8)))
    assert opts.transfer_s(0) == 0.0


def test_heartbeats_publish_the_modelled_link_in_real_time() -> None:
    opts = SimOptions.parse("roofline:h100:llama-3-8b", time_scale=4.0, link="rdma-400")
    links = dict(((peer, kind), rate) for peer, kind, rate in opts.published_links("node-a"))
    assert links == {("node-a", "shm"): 45e9 / 4, ("node-a", "direct"): 45e9 / 4}
    # A cost model's estimate of a hand-off, tokens x bytes / published rate, is then what
    # the decode worker waits.
    nbytes = 1000 * MODELS["llama-3-8b"].kv_bytes_per_token
    # (to within the link latency, which the cost model leaves out)
    assert nbytes / links["node-a", "shm"] == pytest.approx(opts.transfer_s(1000), rel=1e-2)


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
