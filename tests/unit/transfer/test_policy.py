"""choose_transport, default_timeout_s and LinkEstimates, as tables."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import TransportKind
from pdserve.transfer.policy import LinkEstimates, choose_transport, default_timeout_s

MB = 1_000_000

# (prefill host, decode host, tokens, kv bytes, link bytes/s, prefill tokens/s, options, want)
# With latency 1 ms: transfer = 0.001 + bytes / bw; recompute = tokens / tps.
CASES = [
    ("a", "a", 1000, 100 * MB, 1e6, 1e9, {}, TransportKind.SHM),
    ("node-1", "NODE-1", 10, MB, 1e9, 1e3, {}, TransportKind.SHM),
    # 100 MB at 1 GB/s = 0.101 s vs 1000 tokens at 50k tok/s = 0.02 s -> recompute.
    ("a", "b", 1000, 100 * MB, 1e9, 5e4, {}, TransportKind.RECOMPUTE),
    # Same, but 1000 tokens at 5k tok/s = 0.2 s -> moving is cheaper.
    ("a", "b", 1000, 100 * MB, 1e9, 5e3, {}, TransportKind.DIRECT),
    ("a", "b", 1000, 100 * MB, 1e9, 5e3, {"network": TransportKind.STORE}, TransportKind.STORE),
    # Same host, but shm disabled: falls through to the network rules.
    ("a", "a", 1000, 100 * MB, 1e9, 5e3, {"allow_shm": False}, TransportKind.DIRECT),
    # Recompute would win but is not allowed.
    ("a", "b", 1000, 100 * MB, 1e9, 5e4, {"allow_recompute": False}, TransportKind.DIRECT),
    # Empty host names never match.
    ("", "", 1000, 100 * MB, 1e9, 5e3, {}, TransportKind.DIRECT),
    # Latency alone (1 ms) exceeds recomputing 1 token at 10k tok/s (0.1 ms).
    ("a", "b", 1, 1000, 1e12, 1e4, {}, TransportKind.RECOMPUTE),
]


@pytest.mark.parametrize(("src", "dst", "tokens", "nbytes", "bw", "tps", "options", "want"), CASES)
def test_choose_transport(
    src: str,
    dst: str,
    tokens: int,
    nbytes: int,
    bw: float,
    tps: float,
    options: dict[str, object],
    want: TransportKind,
) -> None:
    links = LinkEstimates(default_bytes_per_s=bw, latency_s=0.001)
    got = choose_transport(src, dst, tokens, nbytes, links, tps, **options)
    assert got is want


def test_choose_transport_uses_measurements() -> None:
    links = LinkEstimates(default_bytes_per_s=1e9, latency_s=0.0)
    args = ("a", "b", 1000, 100 * MB)
    assert choose_transport(*args, links, 5e3) is TransportKind.DIRECT  # 0.1 s < 0.2 s
    links.observe("a", "b", TransportKind.DIRECT, 100 * MB, 1.0)  # this link does 100 MB/s
    assert choose_transport(*args, links, 5e3) is TransportKind.RECOMPUTE  # 1 s > 0.2 s
    # The measurement is per direction and per transport.
    assert choose_transport("b", "a", 1000, 100 * MB, links, 5e3) is TransportKind.DIRECT
    store = choose_transport(*args, links, 5e3, network=TransportKind.STORE)
    assert store is TransportKind.STORE


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_tokens": -1}, "num_tokens"),
        ({"kv_bytes": -1}, "kv_bytes"),
        ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s"),
        ({"network": TransportKind.SHM}, "network"),
    ],
)
def test_choose_transport_validates(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {
        "prefill_host": "a",
        "decode_host": "b",
        "num_tokens": 10,
        "kv_bytes": 10,
        "measured": LinkEstimates(),
        "prefill_tokens_per_s": 1.0,
    }
    with pytest.raises(InvalidArgumentError) as err:
        choose_transport(**{**args, **kwargs})
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
    with pytest.raises(InvalidArgumentError):
        default_timeout_s(1, 1.0, floor_s=6.0, ceiling_s=5.0)


def test_link_estimates_ewma() -> None:
    links = LinkEstimates(alpha=0.5, default_bytes_per_s=123.0, latency_s=0.0)
    kind = TransportKind.DIRECT
    assert links.estimate("a", "b", kind).bytes_per_s == 123.0
    assert links.estimate("a", "b", kind).samples == 0
    links.observe("a", "b", kind, 1000, 1.0)  # first sample replaces the default
    assert links.estimate("a", "b", kind).bytes_per_s == pytest.approx(1000.0)
    links.observe("a", "b", kind, 3000, 1.0)  # 1000 + 0.5 * (3000 - 1000)
    est = links.estimate("a", "b", kind)
    assert est.bytes_per_s == pytest.approx(2000.0) and est.samples == 2
    assert links.estimate("a", "b", TransportKind.STORE).samples == 0
    assert links.transfer_time_s("a", "b", kind, 4000) == pytest.approx(2.0)


def test_link_estimates_subtract_latency() -> None:
    links = LinkEstimates(latency_s=0.01)
    # 1 MB in 0.11 s of which 0.01 s is latency: the link moves 10 MB/s.
    est = links.observe("a", "b", TransportKind.DIRECT, MB, 0.11)
    assert est.bytes_per_s == pytest.approx(10 * MB)
    assert est.transfer_time_s(MB) == pytest.approx(0.11)


@pytest.mark.parametrize(("nbytes", "seconds"), [(0, 1.0), (10, 0.0), (-1, 1.0)])
def test_link_estimates_refuse_bad_samples(nbytes: int, seconds: float) -> None:
    with pytest.raises(InvalidArgumentError):
        LinkEstimates().observe("a", "b", TransportKind.DIRECT, nbytes, seconds)


def test_policy_needs_no_torch() -> None:
    # The router and scheduler import the policy; neither should pay for torch.
    code = (
        "import sys, pdserve.transfer.policy, pdserve.transfer.janitor\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
