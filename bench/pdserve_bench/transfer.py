"""``pdserve bench transfer``: KV hand-off bandwidth, and its share of TTFT, per transport.

Everything runs as real processes on this machine: a KV store, a decode worker and two
prefill workers on one checkpoint, the second with ``--no-layerwise`` (layers leave only after
the compute: the no-overlap baseline). Prompts are random (fresh for every sample, so no
prefix cache helps) and prefilled in one step (``--max-batch-tokens``), so the layer hook fires
while every token is computed. Each sample is one Prefill then one Decode RPC with the
transport asked for; the numbers are the workers' own measurements (``TransferTiming``).

Bandwidth ratios come from paired rounds after each size (``transfer_paired.py``): deferred
hand-offs of a prompt in the deferred worker's prefix cache, each between two measurements of
its reference (memcpy, loopback TCP, raw gRPC: ``transfer_refs.py``), the median of the rounds
reported. Samples are in ``transfer_sample.py``, the tables in ``transfer_report.py``.

Sizes above ``--reuse-prefill-above`` (default 8192 tokens; 16K and 32K on the base preset)
are prefilled once and reused from the prefix cache by every transport: they give bandwidth
only (no layer-wise or recompute run), since one 32K prefill takes minutes on a few cores.

Bandwidths: each side's bytes over its busy time, from deferred hand-offs (a sender then has
every layer at hand, so its rate is the link's, not the compute's). ``store`` crosses two
links (prefill -> store, store -> decode), ``direct`` one (into the decode worker's endpoint;
its read is in-process), ``shm`` none (hash and copy into the segment; the reader maps it
and checks the hashes: XXH3-64), ``nixl`` one (the decode worker's one-sided NIXL reads of the
prefill worker's registered blocks; asked for, every worker registers a block pool of
1.25x the largest payload, or of the burst's, with ``--nixl-pool-bytes``).
``mooncake`` is ``store`` through a Mooncake Store (``MOONCAKE``; needs ``pdserve[mooncake]``):
prefill worker -> its segment or the decode worker's (Mooncake places it) -> decode worker,
over the Transfer Engine's TCP; ``scripts/mooncake_raw_bench.py`` measures the library alone.
The transport's bandwidth is its slower side. Shares of TTFT use the time until the decode
worker can start: Prefill RPC (queue, compute, the commit's exposed tail) plus the read.

Each point runs ``--repeats`` times (default 2; at least 4 where its prefill is cheap: reused,
or at most 2048 tokens) and the least disturbed run is kept: the first hand-offs of a size in
a process fault their buffers in (``pdserve.rpc.allocator``: ~9 us a page on a VM whose
balloon takes freed pages back), a serving worker is past that after its first requests, and
the point measures the steady state. The first run of each point is reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import random
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import asdict
from pathlib import Path

import grpc

from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.models.config import ModelConfig
from pdserve.rpc import allocator
from pdserve.telemetry.breakdown import percentile
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from pdserve_bench.transfer_paired import Pair, Reference, rounds
from pdserve_bench.transfer_refs import GrpcSink, References, paired_reference, serve_sink
from pdserve_bench.transfer_report import peak_and_average, report
from pdserve_bench.transfer_sample import Sample
from pdserve_bench.transfer_services import MOONCAKE, Services, wait_for

MOVING = ("shm", "store", "direct", "nixl", "mooncake")
CHEAP_TOKENS = 2048
"""A point whose prefill is cheap (reused from the prefix cache, or at most this many tokens:
seconds a run) runs at least ``--cheap-repeats`` times (default 4): measured here, the first
two 16K hand-offs of a process pair took 3x and 1.5x the steady time (shm), 3.6x and 1.1x
(store)."""
_MIB = 1024 * 1024


async def one(
    s: Services, prefill: str, prompt: list[int], transport: str, *, reused: bool = False
) -> Sample:
    rid = f"bench-{transport}-{random.getrandbits(48):x}"
    decode, reservation = s.address("decode"), ""
    if s.scheduler:
        async with grpc.aio.insecure_channel(s.scheduler) as sch:
            assigned = await scheduler_pb2_grpc.SchedulerStub(sch).Assign(
                scheduler_pb2.AssignRequest(
                    request_id=rid, prompt_tokens=len(prompt), max_tokens=2
                ),
                timeout=60,
            )
        decode, reservation = assigned.decode.address, assigned.reservation_id
    try:
        return await _one(s, prefill, prompt, transport, rid, decode, reservation, reused)
    finally:
        if reservation:
            async with grpc.aio.insecure_channel(s.scheduler) as sch:
                await scheduler_pb2_grpc.SchedulerStub(sch).Release(
                    scheduler_pb2.ReleaseRequest(reservation_id=reservation), timeout=60
                )


def worker_for(prefill: str, transport: str) -> str:
    """The prefill worker that serves ``prefill`` (``prefill`` or ``prefill-deferred``) for
    ``transport``: mooncake has a pair of its own, writing into the Mooncake Store."""
    return (
        prefill.replace("prefill", f"prefill-{MOONCAKE}", 1) if transport == MOONCAKE else prefill
    )


async def _one(
    s: Services, prefill: str, prompt: list[int], transport: str, rid: str, decode: str,
    reservation: str, reused: bool,
) -> Sample:  # fmt: skip
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    wire = transport
    if transport == MOONCAKE:  # the store transport, from the workers writing into Mooncake
        wire = "store"
    prefill = worker_for(prefill, transport)
    async with (
        grpc.aio.insecure_channel(s.address(prefill)) as pch,
        grpc.aio.insecure_channel(decode, options=[("grpc.max_receive_message_length", -1)]) as dch,
    ):
        start = time.perf_counter()
        resp = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=params,
                decode_address=decode, decode_host=socket.gethostname(), transport=wire,
                reservation_id=reservation,
            )
        )  # fmt: skip
        rpc_ms = (time.perf_counter() - start) * 1e3
        timing = common_pb2.Timing()
        async for chunk in decode_pb2_grpc.DecodeStub(dch).Decode(
            decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, first_token_id=resp.first_token_id,
                first_logprob=resp.first_logprob, sampling=params, kv=resp.kv,
                reservation_id=reservation,
            )
        ):  # fmt: skip
            if chunk.HasField("timing"):
                timing = chunk.timing
    sent, got = resp.transfer, timing.transfer
    if got.transport != wire:
        raise WorkerUnavailableError(f"{transport} fell back: {got.fallback_reason}")
    return Sample(
        transport, sent.layerwise, len(prompt), sent.num_bytes, rpc_ms, resp.compute_ms,
        sent.overlap_ms, sent.exposed_ms, sent.bytes_per_s, got.recv_ms, got.bytes_per_s,
        timing.prefill_ms, sent.first_layer_ns or sent.send_start_ns, sent.send_end_ns,
        got.recv_start_ns, got.recv_end_ns, reused, got.wait_ms,
    )  # fmt: skip


class Prompts:
    """Random prompts over the model's vocabulary, a fresh one each call (no prefix reuse)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]


async def burst(
    s: Services, prefill: str, n: int, tokens: int, transport: str, prompts: Prompts
) -> dict[str, float]:
    """``n`` hand-offs at once through one prefill worker: aggregate send and receive rates,
    and the p50 and p99 of their latencies (first byte sent to the KV checked)."""
    samples = await asyncio.gather(*(one(s, prefill, prompts(tokens), transport) for _ in range(n)))
    send = peak_and_average([(x.send_start_ns, x.send_end_ns, x.num_bytes) for x in samples])
    recv = peak_and_average([(x.recv_start_ns, x.recv_end_ns, x.num_bytes) for x in samples])
    latency = [x.latency_ms for x in samples]
    return {
        "send_peak": send[0], "send_avg": send[1], "recv_peak": recv[0], "recv_avg": recv[1],
        "latency_p50_ms": percentile(latency, 50), "latency_p99_ms": percentile(latency, 99),
    }  # fmt: skip


# -- the run -------------------------------------------------------------------------------------
async def measure(
    s: Services,
    prompts: Prompts,
    sizes: Sequence[int],
    transports: Sequence[str],
    n_burst: int,
    burst_tokens: int,
    repeats: int = 1,
    reuse_above: int = 0,
    cheap_repeats: int = 1,
    n_rounds: int = 0,
    reference: Reference | None = None,
) -> tuple[list[Sample], dict[str, dict[str, float]], list[Pair]]:
    """Every (size, transport, mode) ``repeats`` times (``cheap_repeats`` where more: a
    reused or small prompt), keeping the run whose transfer was the least visible (the least
    disturbed, on a shared machine); after each size, ``n_rounds`` paired bandwidth rounds
    (``transfer_paired``) on the deferred worker's last prompt; then the bursts.

    Sizes above ``reuse_above`` (0: none) are bandwidth points only: one prompt per size,
    prefilled once for real by the deferred worker and then served from its prefix cache for
    every other transport and repeat (the layer hook still moves the whole prompt's KV), no
    layer-wise run and no recompute: a 32K prefill takes minutes on a few CPU cores."""
    await one(s, "prefill", prompts(64), "shm")  # warm-up: first-step costs
    await one(s, "prefill-deferred", prompts(64), "shm")
    samples: list[Sample] = []
    pairs: list[Pair] = []
    for n in sizes:
        reused = bool(reuse_above) and n > reuse_above
        shared = prompts(n) if reused else None
        # Each deferred worker's last prompt of this size: in that worker's prefix cache.
        cached = (
            {}
            if shared is None
            else {worker_for("prefill-deferred", t): shared for t in transports}
        )
        for t in transports:
            if reused and t not in MOVING:
                continue
            modes = ("prefill", "prefill-deferred") if t != "recompute" else ("prefill",)
            for prefill in ("prefill-deferred",) if reused else modes:
                times = max(repeats, cheap_repeats) if reused or n <= CHEAP_TOKENS else repeats
                runs = []
                for _ in range(times):
                    prompt = shared or prompts(n)
                    runs.append(await one(s, prefill, prompt, t, reused=reused))
                    if prefill == "prefill-deferred":
                        cached[worker_for(prefill, t)] = prompt
                sample = min(runs, key=lambda x: x.visible_ms if t != "recompute" else x.ready_ms)
                samples.append(dataclasses.replace(sample, first_visible_ms=runs[0].visible_ms))
                mode = "layer-wise" if sample.layerwise else "deferred"
                every = " ".join(f"{r.visible_ms:.1f}" for r in runs)
                print(
                    f"  {t:9s} {n:6d} tokens {mode:10s} ready {sample.ready_ms:8.0f} ms, "
                    f"transfer visible {sample.visible_ms:7.1f} ms (runs: {every})",
                    file=sys.stderr,
                    flush=True,
                )
        moving = [t for t in transports if t in MOVING]
        if n_rounds and reference is not None and cached and moving:
            hand_off = functools.partial(_cached_hand_off, s, cached)
            pairs += await rounds(hand_off, moving, n_rounds, reference, _log, s.cpu_s)
    bursts = {}
    if n_burst > 1:
        for t in (x for x in transports if x in MOVING):
            for prefill in ("prefill", "prefill-deferred"):
                mode = "layer-wise" if prefill == "prefill" else "deferred"
                bursts[f"{t}, {mode}"] = await burst(s, prefill, n_burst, burst_tokens, t, prompts)
    return samples, bursts, pairs


def _cached_hand_off(
    s: Services, cached: dict[str, list[int]], transport: str
) -> Awaitable[Sample]:
    """A deferred hand-off of the prompt the transport's deferred worker last served (every
    moving transport ran a deferred hand-off of this size before), in its prefix cache."""
    prompt = cached[worker_for("prefill-deferred", transport)]
    return one(s, "prefill-deferred", prompt, transport, reused=True)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, help="checkpoint (default: the base demo checkpoint)")
    p.add_argument("--tokens", default="1024,2048,4096,8000,32768", help="prompt sizes")
    p.add_argument(
        "--transports",
        default="shm,store,direct,recompute",
        help="any of shm, store, direct, nixl (the pdserve[nixl] extra), mooncake (store into a "
        "Mooncake Store: the pdserve[mooncake] extra), recompute",
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="runs per point; the least disturbed is kept"
    )
    p.add_argument(
        "--cheap-repeats",
        type=int,
        default=4,
        help=f"runs of a point whose prefill is cheap (reused, or <= {CHEAP_TOKENS} tokens)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=9,
        help="paired bandwidth rounds per point (each hand-off between two references); a "
        "round's ratio spans 1.5-2x on a busy machine, so the median wants more than a few",
    )
    p.add_argument("--reference-mib", type=int, default=256, help="bytes moved by the references")
    p.add_argument("--burst", type=int, default=4, help="concurrent prefills in the burst")
    p.add_argument("--burst-tokens", type=int, default=1024)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=0,
        help="per worker (0: 2 GiB, or 1.25x the largest prompt's KV if more)",
    )
    p.add_argument("--reuse-prefill-above", type=int, default=8192, metavar="TOKENS",
                   help="larger: one prefill reused by all transports, bandwidth only")  # fmt: skip
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag")
    p.add_argument("--json", type=Path, help="write every sample here")
    p.add_argument("--from-json", type=Path, help="only print the report of an earlier --json")
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temporary dir)")
    p.add_argument("--grpc-sink", action="store_true", help=argparse.SUPPRESS)  # the reference
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    allocator.tune_for_streams()  # as the KV-moving services do: references alike
    if args.grpc_sink:
        if args.port_file is None:
            raise InvalidArgumentError("--port-file", "the sink needs one")
        asyncio.run(serve_sink(args.port_file))
        return 0
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        refs = References(**saved["references"])
        pairs = [Pair(**x) for x in saved.get("pairs", [])]
        print(report([Sample(**x) for x in saved["samples"]], saved["bursts"], refs, pairs))
        return 0
    counts = (("--repeats", args.repeats), ("--cheap-repeats", args.cheap_repeats))
    if args.rounds < 0:
        raise InvalidArgumentError("--rounds", f"must be >= 0, got {args.rounds}")
    for flag, value in counts:
        if value < 1:
            raise InvalidArgumentError(flag, f"must be >= 1, got {value}")
    sizes = [int(x) for x in args.tokens.split(",") if x]
    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - {*MOVING, "recompute"}
    if unknown or not sizes:
        raise InvalidArgumentError("--transports", f"unknown: {sorted(unknown)}")
    if args.model is None:
        from pdserve.launcher import default_model

        args.model = default_model("base")
    config = ModelConfig.from_dir(args.model)
    if max(sizes) >= config.max_position_embeddings:
        raise InvalidArgumentError(
            "--tokens",
            f"{max(sizes)} tokens leave no room for an output in {args.model}'s "
            f"{config.max_position_embeddings} positions",
        )
    prompts = Prompts(config.vocab_size)
    dtype = json.loads((args.model / "config.json").read_text()).get("torch_dtype", "float32")
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    kv_per_token *= 2 if dtype in ("bfloat16", "float16") else 4
    kv_cache_bytes = args.kv_cache_bytes or max(2 * 1024 * _MIB, max(sizes) * kv_per_token * 5 // 4)
    largest = max(max(sizes), args.burst * args.burst_tokens) * kv_per_token
    nixl_pool = (
        ["--nixl-pool-bytes", str(largest * 5 // 4 + 16 * _MIB)] if "nixl" in transports else []
    )
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-bench-transfer-"))
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        size = args.reference_mib * _MIB
        sink = stack.enter_context(GrpcSink(log_dir, wait_for))

        def references(when: str) -> References:
            print(f"measuring memcpy, loopback TCP and raw gRPC ({when}) ...", file=sys.stderr)
            found = References.measure(sink, size)
            print(f"  {found.summary()}", file=sys.stderr, flush=True)
            return found

        refs = references("before")
        worker_args = [
            "--max-batch-tokens", str(args.max_batch_tokens), "--kv-cache-bytes",
            str(kv_cache_bytes), "--kv-transfer-timeout-s", "120", "--kv-lease-s", "600",
            # Whole payloads: a reused prompt must not shrink to what the decoder lacks.
            "--no-decode-prefix", "--log-level", "WARNING", *nixl_pool, *args.worker_arg,
        ]  # fmt: skip
        print(f"starting services (logs in {log_dir}) ...", file=sys.stderr, flush=True)
        services = Services.start(
            args.model, log_dir, worker_args,
            redis="nixl" in transports, mooncake=MOONCAKE in transports,
        )  # fmt: skip
        try:
            samples, bursts, pairs = asyncio.run(
                measure(
                    services,
                    prompts,
                    sizes,
                    transports,
                    args.burst,
                    args.burst_tokens,
                    args.repeats,
                    args.reuse_prefill_above,
                    args.cheap_repeats,
                    args.rounds,
                    paired_reference(sink, size),
                )
            )
        finally:
            services.stop()
        refs = refs.best(references("after"))
    print(report(samples, bursts, refs, pairs))
    if args.json is not None:
        saved = {
            "references": asdict(refs),
            "bursts": bursts,
            "samples": [asdict(x) for x in samples],
            "pairs": [asdict(x) for x in pairs],
        }
        args.json.write_text(json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":  # the raw gRPC reference's sink runs as ``python -m`` this module
    sys.exit(main(sys.argv[1:]))
