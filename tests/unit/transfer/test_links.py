"""The link model: choose_transport, Links (priors, EWMA, published) and default_timeout_s."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import HandoffRecord, TransportKind
from pdserve.transfer.links import (
    PRIORS,
    Handoff,
    Link,
    Links,
    allowed_transports,
    choose_transport,
    default_timeout_s,
)

MB = 1_000_000
SHM, DIRECT, STORE, RECOMPUTE = (
    TransportKind.SHM, TransportKind.DIRECT, TransportKind.STORE, TransportKind.RECOMPUTE
)  # fmt: skip


def links_at(host: str, bytes_per_s: float, *peers: str) -> Links:
    """``host``'s links to ``peers`` measured at ``bytes_per_s`` on every transport."""
    kinds = (SHM, DIRECT, STORE)
    return Links(host, [(p, k.value, bytes_per_s) for p in peers for k in kinds])


# (prefill host, decode host, tokens, kv bytes, link bytes/s, prefill s/token, settings, want)
# Transfer = 0.001 + bytes / bw; recompute = tokens x s/token (no step overhead here).
CASES = [
    ("a", "a", 1000, 100 * MB, 1e6, 1e-9, {}, SHM),
    ("node-1", "NODE-1", 10, MB, 1e9, 1e-3, {}, SHM),
    # 100 MB at 1 GB/s = 0.101 s vs 1000 tokens at 20 us = 0.02 s -> recompute.
    ("a", "b", 1000, 100 * MB, 1e9, 2e-5, {}, RECOMPUTE),
    # Same, but 1000 tokens at 200 us = 0.2 s -> moving is cheaper.
    ("a", "b", 1000, 100 * MB, 1e9, 2e-4, {}, DIRECT),
    ("a", "b", 1000, 100 * MB, 1e9, 2e-4, {"network": STORE}, STORE),
    # Same host, but shm disabled: falls through to the network rules.
    ("a", "a", 1000, 100 * MB, 1e9, 2e-4, {"allow_shm": False}, DIRECT),
    # Recompute would win but is not allowed, or the prefill is not measured yet.
    ("a", "b", 1000, 100 * MB, 1e9, 2e-5, {"allow_recompute": False}, DIRECT),
    ("a", "b", 1000, 100 * MB, 1e9, 0.0, {}, DIRECT),
    # Empty host names never match.
    ("", "", 1000, 100 * MB, 1e9, 2e-4, {}, DIRECT),
    # Latency alone (1 ms) exceeds recomputing 1 token at 0.1 ms.
    ("a", "b", 1, 1000, 1e12, 1e-4, {}, RECOMPUTE),
    # A forced transport is used as given, whatever the link.
    ("a", "b", 1000, 100 * MB, 1e9, 2e-5, {"forced": SHM}, SHM),
    ("a", "a", 1000, 100 * MB, 1e9, 0.0, {"forced": RECOMPUTE}, RECOMPUTE),
]


@pytest.mark.parametrize(
    ("src", "dst", "tokens", "nbytes", "bw", "cost", "settings", "want"), CASES
)
def test_choose_transport(
    src: str,
    dst: str,
    tokens: int,
    nbytes: int,
    bw: float,
    cost: float,
    settings: dict[str, object],
    want: TransportKind,
) -> None:
    links = links_at(src, bw, dst)
    got = choose_transport(
        links, dst, tokens, nbytes, prefill_token_s=cost,
        allowed=allowed_transports(**settings),  # type: ignore[arg-type]
    )  # fmt: skip
    assert got.kind is want
    moved = 0.001 + nbytes / bw
    assert got.seconds == pytest.approx(tokens * cost if want is RECOMPUTE else moved)


def test_the_recompute_estimate_counts_a_step_s_overhead() -> None:
    links = links_at("a", 1e9, "b")  # 100 MB: 0.101 s; 1000 tokens: 0.02 s + the overhead
    args = (links, "b", 1000, 100 * MB)
    assert choose_transport(*args, prefill_token_s=2e-5, step_overhead_s=0.05).kind is RECOMPUTE
    slow = choose_transport(*args, prefill_token_s=2e-5, step_overhead_s=0.09)
    assert slow.kind is DIRECT and slow.seconds == pytest.approx(0.101)


def test_choose_transport_uses_measurements_and_priors() -> None:
    links = Links("a")
    args = ("b", 1000, 100 * MB)
    got = choose_transport(links, *args, prefill_token_s=2e-4)  # 0.101 s < 0.2 s
    assert got.kind is DIRECT and got.seconds == pytest.approx(0.001 + 100 * MB / PRIORS[DIRECT])
    links.measure("b", DIRECT, 100 * MB, 1.001)  # this link does 100 MB/s
    assert choose_transport(links, *args, prefill_token_s=2e-4).kind is RECOMPUTE  # 1 s > 0.2 s
    # The measurement is per peer and per transport: store keeps its prior (100 MB: 0.201 s).
    assert choose_transport(links, "c", 1000, 100 * MB, prefill_token_s=2e-4).kind is DIRECT
    store = choose_transport(links, *args, prefill_token_s=3e-4, allowed=(STORE, RECOMPUTE))
    assert store == Handoff(STORE, pytest.approx(0.201))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_tokens": -1}, "num_tokens"),
        ({"kv_bytes": -1}, "kv_bytes"),
        ({"prefill_token_s": -1.0}, "prefill_token_s"),
        ({"allowed": ()}, "allowed"),
    ],
)
def test_choose_transport_validates(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {
        "links": Links("a"),
        "peer": "b",
        "num_tokens": 10,
        "kv_bytes": 10,
        "prefill_token_s": 1.0,
    }
    with pytest.raises(InvalidArgumentError) as err:
        choose_transport(**{**args, **kwargs})  # type: ignore[arg-type]
    assert err.value.field == field


@pytest.mark.parametrize(
    ("nbytes", "bw", "want"),
    [
        (0, 1e9, 1.0),  # 0.5 s slack, raised to the 1 s floor
        (100 * MB, 1e9, 1.0),  # 0.9 s, raised to the floor
        (500 * MB, 1e9, 4 * 0.5 + 0.5),  # within bounds: 4x expected + slack
        (10_000 * MB, 1e9, 5.0),  # 40.5 s, capped
        (200 * MB, 1e9, 4 * 0.2 + 0.5),
    ],
)
def test_default_timeout(nbytes: int, bw: float, want: float) -> None:
    assert default_timeout_s(nbytes, bw) == pytest.approx(want)


def test_default_timeout_validates() -> None:
    with pytest.raises(InvalidArgumentError):
        default_timeout_s(1, 0.0)
    with pytest.raises(InvalidArgumentError):
        default_timeout_s(-1, 1.0)


def test_links_ewma_over_the_priors() -> None:
    links = Links("a", alpha=0.5)
    assert links.link("b", DIRECT) == Link(1e9) and links.link("b", STORE) == Link(0.5e9)
    assert links.link("b", SHM) == Link(4e9) and links.published() == ()
    links.measure("b", DIRECT, 1000, 1.001)  # first sample replaces the prior
    assert links.link("b", DIRECT).bytes_per_s == pytest.approx(1000.0)
    links.measure("b", DIRECT, 3000, 1.001)  # 1000 + 0.5 * (3000 - 1000)
    assert links.link("b", DIRECT).bytes_per_s == pytest.approx(2000.0)
    assert links.link("b", STORE) == Link(0.5e9)
    assert links.link("b", DIRECT).transfer_time_s(4000) == pytest.approx(2.001)
    assert links.published() == (("b", "direct", pytest.approx(2000.0)),)
    # What a heartbeat publishes reads back as the same links.
    again = Links("a", links.published())
    assert again.link("b", DIRECT) == links.link("b", DIRECT)


def test_links_subtract_the_latency_and_learn_from_records() -> None:
    links = Links("a")
    # 1 MB in 0.101 s of which 0.001 s is latency: the link moves 10 MB/s.
    link = links.measure("b", DIRECT, MB, 0.101)
    assert link.bytes_per_s == pytest.approx(10 * MB)
    assert link.transfer_time_s(MB) == pytest.approx(0.101)
    # A hand-off's record: the receiver's read time, else the sender's busy time.
    links.observe("c", HandoffRecord("shm", num_bytes=MB, busy_ns=int(0.011e9)))
    assert links.link("c", SHM).bytes_per_s == pytest.approx(100 * MB)
    links.observe("c", HandoffRecord("recompute"))  # moved nothing: nothing learned
    links.observe("c", HandoffRecord("store", num_bytes=MB))  # no time measured
    assert len(links.published()) == 2


def test_modelled_links_do_not_move() -> None:
    links = Links("a", [("a", "shm", 5e9), ("a", "warp-drive", 1e12)], modelled=True)
    links.measure("a", SHM, MB, 1.0)
    assert links.link("a", SHM) == Link(5e9)
    assert links.published() == (("a", "shm", 5e9),)  # the unknown transport was skipped


def test_zero_bytes_cost_nothing_negative_refused() -> None:
    assert Link(1.0, 0.5).transfer_time_s(0) == 0.0
    assert Link(100.0, 0.5).transfer_time_s(300) == pytest.approx(3.5)
    with pytest.raises(InvalidArgumentError):
        Link(1.0).transfer_time_s(-1)


@pytest.mark.parametrize(("nbytes", "seconds"), [(0, 1.0), (10, 0.0), (-1, 1.0)])
def test_links_refuse_bad_samples(nbytes: int, seconds: float) -> None:
    with pytest.raises(InvalidArgumentError):
        Links("a").measure("b", DIRECT, nbytes, seconds)
    with pytest.raises(InvalidArgumentError) as err:
        Links("a", alpha=0.0)
    assert err.value.field == "alpha"


def test_the_link_model_needs_no_torch() -> None:
    # The router and scheduler import the link model; neither should pay for torch.
    code = (
        "import sys, pdserve.transfer.links, pdserve.transfer.janitor\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
