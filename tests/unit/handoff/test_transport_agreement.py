"""The scheduler prices the hand-off the prefill worker will make: over a grid of situations
(hosts, settings, measured links, step models, sizes), the transport the cost model prices from
the worker's heartbeat is the one the worker's plan takes (``handoff.plan.choose_kind``), at
the time of that link."""

from __future__ import annotations

import itertools

import pytest

from pdserve.backends import Capacity
from pdserve.engine.step_meter import StepModel
from pdserve.handoff.plan import TransferOptions, choose_kind
from pdserve.scheduling.costmodel import CostModel
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.transfer.base import HandoffRecord, TransportKind
from pdserve.transfer.links import Links
from pdserve.worker.heartbeat import WorkerIdentity, worker_info

MB = 1_000_000
SHM, DIRECT, STORE, RECOMPUTE = (
    TransportKind.SHM, TransportKind.DIRECT, TransportKind.STORE, TransportKind.RECOMPUTE
)  # fmt: skip

SETTINGS = [
    TransferOptions(),
    TransferOptions(allow_shm=False),
    TransferOptions(network=STORE),
    TransferOptions(allow_recompute=False),
    TransferOptions(transport="store"),
    TransferOptions(transport="recompute"),
]
# What the prefill worker ("node-a") measured: nothing, a slow link, a fast one. Each sample
# moves 10 MB; the link's bandwidth is 10 MB over the time less the 1 ms latency.
MEASURED = {
    "none": (),
    "slow": (("node-b", "direct", 1.001), ("node-b", "store", 2.001), ("node-a", "shm", 0.101)),
    "fast": (("node-b", "direct", 0.011), ("node-b", "store", 0.021), ("node-a", "shm", 0.003)),
}
PRIORS = {SHM: 4e9, DIRECT: 1e9, STORE: 0.5e9}  # bytes/s of a link nothing measured
STEPS = [StepModel(), StepModel(0.01, 0.001, 2e-5), StepModel(0.002, 0.001, 1e-3)]
DECODE_HOSTS = ["node-a", "NODE-A", "node-b"]
SIZES = [(16, 1000), (4096, 100_000)]  # (prompt tokens, KV bytes per token)


def prefill_side(measured: str) -> tuple[Links, dict[tuple[str, str], float]]:
    """The worker's links fed by its hand-offs' records, and the bandwidths they show."""
    links = Links("node-a")
    bandwidths = {}
    for peer, kind, seconds in MEASURED[measured]:
        record = HandoffRecord(kind, num_bytes=10 * MB, busy_ns=round(seconds * 1e9))
        links.observe(peer, record)
        bandwidths[peer, kind] = 10 * MB / (seconds - 0.001)
    return links, bandwidths


def heartbeat(
    links: Links, options: TransferOptions, steps: StepModel, kv_bytes_per_token: int
) -> WorkerInfo:
    """What the scheduler reads of the worker: its heartbeat, through JSON."""
    identity = WorkerIdentity(
        "p0", WorkerRole.PREFILL, "10.0.0.1:1", "node-a", "fp", 2048,
        kv_bytes_per_token=kv_bytes_per_token,
        transports=tuple(k.value for k in options.transports),
    )  # fmt: skip
    load = Capacity(blocks_total=100, blocks_free=100, block_size=16, queued_tokens=0,
                    running=0, waiting=0, steps=steps)  # fmt: skip
    info = worker_info(identity, load, draining=False, links=links.published())
    return WorkerInfo.from_json(info.to_json())


def decode_side(host: str) -> WorkerInfo:
    return WorkerInfo("d0", WorkerRole.DECODE, "10.0.0.2:1", host, "fp", 100, 100, 16, 2048)


def test_the_scheduler_prices_the_transport_the_worker_takes() -> None:
    model = CostModel()
    seen = set()
    grid = itertools.product(SETTINGS, MEASURED, STEPS, DECODE_HOSTS, SIZES)
    for options, measured, steps, host, (tokens, per_token) in grid:
        links, bandwidths = prefill_side(measured)
        taken = choose_kind(
            options, links, tokens, tokens * per_token, steps,
            decode_address="10.0.0.2:1", decode_host=host,
        )  # fmt: skip
        beat = heartbeat(links, options, steps, per_token)
        priced = model.handoff(beat, decode_side(host), tokens)
        case = (options, measured, steps, host, tokens)
        assert priced.kind is taken, case
        if taken is RECOMPUTE:
            expected = steps.overhead_s + tokens * steps.prefill_token_s
        else:
            bandwidth = bandwidths.get((host.lower(), taken.value)) or PRIORS[taken]
            expected = 0.001 + tokens * per_token / bandwidth
        assert priced.seconds == pytest.approx(expected), case
        assert model.transfer_s(beat, decode_side(host), tokens) == priced.seconds
        seen.add(taken)
    assert seen == {SHM, DIRECT, STORE, RECOMPUTE}  # the grid reaches every rule
