"""``pdserve bench transfer``: KV hand-off bandwidth, and its share of TTFT, per transport.

Everything runs as real processes on this machine: a KV store, a decode worker and two
prefill workers on one checkpoint, the second with ``--no-layerwise`` (layers leave only after
the compute: the no-overlap baseline). Prompts are random (fresh for every sample, so no
prefix cache helps) and prefilled in one step (``--max-batch-tokens``), so the layer hook fires
while every token is computed. Each sample is one Prefill then one Decode RPC with the
transport asked for; the numbers are the workers' own measurements (``TransferTiming``).

Measured in the same run, as references:

* memcpy: ``Tensor.copy_`` of a 256 MiB buffer, bytes of one copy per second (median of 5);
* loopback TCP: one socket on 127.0.0.1, a sender thread ``sendall`` 1 MiB pieces of 256 MiB,
  the receiver ``recv_into`` one buffer (median of 3).

Bandwidths: each side's bytes over its busy time, from the no-overlap runs (a sender then has
every layer at hand, so its rate is the link's, not the compute's). ``store`` crosses two
links (prefill -> store, store -> decode), ``direct`` one (into the decode worker's endpoint;
its read is in-process), ``shm`` none (copy into the segment, copy out; both check CRCs).
The transport's bandwidth is its slower side. Shares of TTFT use the time until the decode
worker can start: Prefill RPC (queue, compute, the commit's exposed tail) plus the read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch

from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.kvstore.client import KVStoreClient
from pdserve.models.config import ModelConfig
from pdserve.rpc.server import build_server
from pdserve.service_process import ServiceProcess, healthy, terminate
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

MOVING = ("shm", "store", "direct")
_MIB = 1024 * 1024


# -- references ----------------------------------------------------------------------------------
def memcpy_bytes_per_s(size: int = 256 * _MIB, repeats: int = 5) -> float:
    """One ``copy_`` of ``size`` bytes per second, median (first touch excluded)."""
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return size / statistics.median(times)


def tcp_bytes_per_s(size: int = 256 * _MIB, piece: int = _MIB, repeats: int = 3) -> float:
    """Raw loopback TCP: bytes per second from the first send to the last byte received."""
    data = memoryview(bytearray(os.urandom(piece)))

    def send(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            for _ in range(size // piece):
                s.sendall(data)

    rates = []
    for _ in range(repeats):
        with socket.create_server(("127.0.0.1", 0)) as server:
            sender = threading.Thread(target=send, args=(server.getsockname()[1],))
            sender.start()
            conn, _ = server.accept()
            received = bytearray(piece)
            with conn:
                start, got = time.perf_counter(), 0
                while got < size and (n := conn.recv_into(received)):
                    got += n
                rates.append(got / (time.perf_counter() - start))
            sender.join()
    return statistics.median(rates)


class _Sink(kvstore_pb2_grpc.KVStoreServicer):
    """A KVStore whose Put only counts bytes: gRPC's own cost, nothing of pdserve's."""

    async def Put(  # noqa: N802 - gRPC method names
        self, request_iterator: AsyncIterator[kvstore_pb2.KVChunk], context: object
    ) -> kvstore_pb2.PutResponse:
        n = 0
        async for chunk in request_iterator:
            n += len(chunk.data)
        return kvstore_pb2.PutResponse(num_bytes=n)


async def _serve_sink(port_file: Path) -> None:
    server, port, health = build_server(
        [(kvstore_pb2_grpc.add_KVStoreServicer_to_server, _Sink())], port=0
    )
    await server.start()
    await health.set_serving()
    port_file.write_text(f"{port}\n")
    await server.wait_for_termination()


def grpc_bytes_per_s(log_dir: Path, size: int = 256 * _MIB, repeats: int = 3) -> float:
    """Raw gRPC (grpcio, asyncio): a Put stream of 1 MiB chunks into a sink in another
    process, bytes per second (median): what any transport on gRPC in Python can reach."""
    sink = ServiceProcess(
        "grpc-sink", "pdserve.bench.transfer", ["--grpc-sink"],
        log_dir / "grpc-sink.port", log_dir / "grpc-sink.log",
    )  # fmt: skip
    sink.spawn({**os.environ})
    try:
        _wait([sink], 60.0)
        piece = os.urandom(_MIB)

        async def put() -> float:
            async with KVStoreClient(sink.address) as client:

                async def pieces() -> AsyncIterator[tuple[bytes, int]]:
                    crc = zlib.crc32(piece)
                    for _ in range(size // _MIB):
                        yield piece, crc

                start = time.perf_counter()
                await client.put_stream("k", pieces())
                return size / (time.perf_counter() - start)

        return statistics.median(asyncio.run(put()) for _ in range(repeats))
    finally:
        terminate([sink.proc] if sink.proc else [], 5.0)


@dataclass(frozen=True)
class References:
    """Bytes per second of the references, measured in the same run."""

    memcpy: float
    tcp: float
    grpc: float


# -- the cluster ---------------------------------------------------------------------------------
@dataclass
class Services:
    """KV store, decode worker, layer-wise and deferred prefill workers."""

    processes: list[ServiceProcess]

    def address(self, name: str) -> str:
        return next(p for p in self.processes if p.name == name).address

    @classmethod
    def start(cls, model: Path, log_dir: Path, worker_args: Sequence[str]) -> Services:
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONUNBUFFERED": "1"}

        def proc(name: str, module: str, args: list[str]) -> ServiceProcess:
            return ServiceProcess(
                name, module, args, log_dir / f"{name}.port", log_dir / f"{name}.log"
            )

        store = proc("kvstore", "services.kvstore", ["--capacity-bytes", str(8 * 1024 * _MIB)])
        store.spawn(env)
        _wait([store])
        common = ["--model", str(model), "--kvstore", store.address, *worker_args]
        workers = [
            proc("decode", "services.decode", common),
            proc("prefill", "services.prefill", common),
            proc("prefill-deferred", "services.prefill", [*common, "--no-layerwise"]),
        ]
        for w in workers:
            w.spawn(env)
        _wait(workers)
        return cls([store, *workers])

    def stop(self) -> None:
        terminate([p.proc for p in self.processes if p.proc is not None], 10.0)


def _wait(procs: list[ServiceProcess], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while not (p.read_port() and healthy(p.address)):
            p.check_alive()
            if time.monotonic() > deadline:
                raise WorkerUnavailableError(f"{p.name} did not start; see {p.log_file}")
            time.sleep(0.1)  # polling a child's port file: nothing to block on


# -- samples -------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One hand-off as the workers measured it (ms, bytes, bytes/s)."""

    transport: str
    layerwise: bool
    tokens: int
    num_bytes: int
    prefill_rpc_ms: float
    compute_ms: float
    overlap_ms: float
    exposed_ms: float
    send_bytes_per_s: float
    recv_ms: float
    recv_bytes_per_s: float
    recompute_ms: float
    send_start_ns: int
    send_end_ns: int
    recv_start_ns: int
    recv_end_ns: int

    @property
    def send_span_bytes_per_s(self) -> float:
        """Bytes over the sender's whole span, first layer to acknowledgement (deferred: the
        pipeline of copy, checksum and wire with every layer at hand)."""
        ns = self.send_end_ns - self.send_start_ns
        return self.num_bytes / (ns / 1e9) if ns > 0 else 0.0

    @property
    def ready_ms(self) -> float:
        """Until the decode worker can start: the Prefill RPC, then the read (or recompute)."""
        return self.prefill_rpc_ms + self.recv_ms + self.recompute_ms

    @property
    def visible_ms(self) -> float:
        """Transfer time not hidden behind the compute."""
        return self.exposed_ms + self.recv_ms

    @property
    def share(self) -> float:
        return self.visible_ms / self.ready_ms if self.ready_ms else 0.0

    @property
    def hidden(self) -> float:
        """Of the sender's transfer time, the part that ran while the prefill computed."""
        total = self.overlap_ms + self.exposed_ms
        return self.overlap_ms / total if total else 0.0


async def one(s: Services, prefill: str, prompt: list[int], transport: str) -> Sample:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rid = f"bench-{transport}-{random.getrandbits(48):x}"
    decode = s.address("decode")
    async with (
        grpc.aio.insecure_channel(s.address(prefill)) as pch,
        grpc.aio.insecure_channel(decode, options=[("grpc.max_receive_message_length", -1)]) as dch,
    ):
        start = time.perf_counter()
        resp = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=params,
                decode_address=decode, decode_host=socket.gethostname(), transport=transport,
            )
        )  # fmt: skip
        rpc_ms = (time.perf_counter() - start) * 1e3
        timing = common_pb2.Timing()
        async for chunk in decode_pb2_grpc.DecodeStub(dch).Decode(
            decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, first_token_id=resp.first_token_id,
                first_logprob=resp.first_logprob, sampling=params, kv=resp.kv,
            )
        ):  # fmt: skip
            if chunk.HasField("timing"):
                timing = chunk.timing
    sent, got = resp.transfer, timing.transfer
    if got.transport != transport:
        raise WorkerUnavailableError(f"{transport} fell back: {got.fallback_reason}")
    return Sample(
        transport, sent.layerwise, len(prompt), sent.num_bytes, rpc_ms, resp.compute_ms,
        sent.overlap_ms, sent.exposed_ms, sent.bytes_per_s, got.recv_ms, got.bytes_per_s,
        timing.prefill_ms, sent.first_layer_ns or sent.send_start_ns, sent.send_end_ns,
        got.recv_start_ns, got.recv_end_ns,
    )  # fmt: skip


class Prompts:
    """Random prompts over the model's vocabulary, a fresh one each call (no prefix reuse)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]


def peak_and_average(spans: Sequence[tuple[int, int, int]]) -> tuple[float, float]:
    """Aggregate bytes/s of transfers ``(start_ns, end_ns, bytes)`` running together: the
    peak (each spread evenly over its span, summed where they overlap) and the average
    (all bytes over the whole window)."""
    spans = [s for s in spans if s[1] > s[0]]
    if not spans:
        return 0.0, 0.0
    events = sorted({t for s in spans for t in s[:2]})
    peak = max(sum(b / ((e - s) / 1e9) for s, e, b in spans if s <= t < e) for t in events[:-1])
    window = (max(s[1] for s in spans) - min(s[0] for s in spans)) / 1e9
    return peak, sum(s[2] for s in spans) / window


async def burst(
    s: Services, prefill: str, n: int, tokens: int, transport: str, prompts: Prompts
) -> dict[str, float]:
    """``n`` hand-offs at once through one prefill worker: aggregate send and receive rates."""
    samples = await asyncio.gather(*(one(s, prefill, prompts(tokens), transport) for _ in range(n)))
    send = peak_and_average([(x.send_start_ns, x.send_end_ns, x.num_bytes) for x in samples])
    recv = peak_and_average([(x.recv_start_ns, x.recv_end_ns, x.num_bytes) for x in samples])
    return {"send_peak": send[0], "send_avg": send[1], "recv_peak": recv[0], "recv_avg": recv[1]}


# -- the run -------------------------------------------------------------------------------------
async def measure(
    s: Services,
    prompts: Prompts,
    sizes: Sequence[int],
    transports: Sequence[str],
    n_burst: int,
    burst_tokens: int,
    repeats: int = 1,
) -> tuple[list[Sample], dict[str, dict[str, float]]]:
    """Every (size, transport, mode) ``repeats`` times, keeping the run whose transfer was
    the least visible (the least disturbed, on a shared machine); then the bursts."""
    await one(s, "prefill", prompts(64), "shm")  # warm-up: first-step costs
    await one(s, "prefill-deferred", prompts(64), "shm")
    samples = []
    for n in sizes:
        for t in transports:
            for prefill in ("prefill", "prefill-deferred") if t != "recompute" else ("prefill",):
                runs = [await one(s, prefill, prompts(n), t) for _ in range(repeats)]
                sample = min(runs, key=lambda x: x.visible_ms if t != "recompute" else x.ready_ms)
                samples.append(sample)
                mode = "layer-wise" if sample.layerwise else "deferred"
                ready, visible = sample.ready_ms, sample.visible_ms
                note = f"  {t:9s} {n:6d} tokens {mode:10s} ready {ready:8.0f} ms"
                print(f"{note}, transfer visible {visible:7.1f} ms", file=sys.stderr, flush=True)
    bursts = {}
    if n_burst > 1:
        for t in (x for x in transports if x in MOVING):
            for prefill in ("prefill", "prefill-deferred"):
                mode = "layer-wise" if prefill == "prefill" else "deferred"
                bursts[f"{t}, {mode}"] = await burst(s, prefill, n_burst, burst_tokens, t, prompts)
    return samples, bursts


def report(samples: Sequence[Sample], bursts: dict[str, dict[str, float]], ref: References) -> str:
    """The results as markdown tables (definitions in ``docs/benchmarks.md``)."""
    gb = 1e9
    lines = [
        f"References (this run): memcpy {ref.memcpy / gb:.2f} GB/s, loopback TCP "
        f"{ref.tcp / gb:.2f} GB/s, raw gRPC {ref.grpc / gb:.2f} GB/s.",
        "",
        "| transport | tokens | KV MB | send GB/s | recv GB/s | of memcpy / TCP | of raw gRPC "
        "| TTFT ms | visible ms, layer-wise / deferred | share of TTFT, layer-wise / deferred "
        "| hidden |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def find(t: str, n: int, layerwise: bool) -> Sample | None:
        return next(
            (x for x in samples if (x.transport, x.tokens, x.layerwise) == (t, n, layerwise)), None
        )

    for t in dict.fromkeys(x.transport for x in samples):
        for n in dict.fromkeys(x.tokens for x in samples):
            lw, de = find(t, n, True), find(t, n, False)
            if lw is None:
                continue
            if t == "recompute":
                lines.append(
                    f"| recompute | {n} | - | - | - | - | - | {lw.prefill_rpc_ms:.0f} | "
                    f"{lw.recompute_ms:.0f} (decode-side prefill) | "
                    f"{lw.recompute_ms / lw.ready_ms:.0%} | - |"
                )
                continue
            base = de or lw  # link rates from the no-overlap run: not paced by the compute
            send, recv = base.send_span_bytes_per_s, base.recv_bytes_per_s
            # direct's read is in-process (assembled on arrival): its link is the send alone.
            bw = send if t == "direct" else min(send, recv)
            of_ref = f"{bw / (ref.memcpy if t == 'shm' else ref.tcp):.0%}"
            of_grpc = "-" if t == "shm" else f"{bw / ref.grpc:.0%}"
            visible = f"{lw.visible_ms:.0f} / {de.visible_ms:.0f}" if de else f"{lw.visible_ms:.0f}"
            share = f"{lw.share:.1%} / {de.share:.1%}" if de else f"{lw.share:.1%}"
            hidden = f"{1 - lw.visible_ms / de.visible_ms:.0%}" if de and de.visible_ms else "-"
            # direct: assembled as it landed; the read only hands the payload over.
            recv_text = "on arrival" if t == "direct" else f"{recv / gb:.2f}"
            lines.append(
                f"| {t} | {n} | {lw.num_bytes / 1e6:.0f} | {send / gb:.2f} | {recv_text} | "
                f"{of_ref} | {of_grpc} | {lw.prefill_rpc_ms:.0f} | {visible} | {share} | "
                f"{hidden} |"
            )
    if bursts:
        lines += [
            "",
            "| transport | send peak GB/s | send average | recv peak | recv average |",
            "|---|---:|---:|---:|---:|",
        ]
        for t, b in bursts.items():
            received = (
                "on arrival | on arrival"
                if t.startswith("direct")
                else f"{b['recv_peak'] / gb:.2f} | {b['recv_avg'] / gb:.2f}"
            )
            lines.append(
                f"| {t} | {b['send_peak'] / gb:.2f} | {b['send_avg'] / gb:.2f} | {received} |"
            )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, help="checkpoint (default: the base demo checkpoint)")
    p.add_argument("--tokens", default="1024,2048,4096,8000", help="prompt sizes")
    p.add_argument("--transports", default="shm,store,direct,recompute")
    p.add_argument("--repeats", type=int, default=1, help="runs per point; the best is kept")
    p.add_argument("--reference-mib", type=int, default=256, help="bytes moved by the references")
    p.add_argument("--burst", type=int, default=4, help="concurrent prefills in the burst")
    p.add_argument("--burst-tokens", type=int, default=1024)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-bytes", type=int, default=2 * 1024 * _MIB)
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
    if args.grpc_sink:
        if args.port_file is None:
            raise InvalidArgumentError("--port-file", "the sink needs one")
        asyncio.run(_serve_sink(args.port_file))
        return 0
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        refs = References(**saved["references"])
        print(report([Sample(**x) for x in saved["samples"]], saved["bursts"], refs))
        return 0
    sizes = [int(x) for x in args.tokens.split(",") if x]
    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - {*MOVING, "recompute"}
    if unknown or not sizes:
        raise InvalidArgumentError("--transports", f"unknown: {sorted(unknown)}")
    if args.model is None:
        from pdserve.launcher import default_model

        args.model = default_model("base")
    prompts = Prompts(ModelConfig.from_dir(args.model).vocab_size)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-transfer-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        print("measuring memcpy, loopback TCP and raw gRPC ...", file=sys.stderr, flush=True)
        size = args.reference_mib * _MIB
        refs = References(
            memcpy_bytes_per_s(size), tcp_bytes_per_s(size), grpc_bytes_per_s(log_dir, size)
        )
        worker_args = [
            "--max-batch-tokens", str(args.max_batch_tokens), "--kv-cache-bytes",
            str(args.kv_cache_bytes), "--kv-transfer-timeout-s", "120", "--kv-lease-s", "600",
            "--log-level", "WARNING", *args.worker_arg,
        ]  # fmt: skip
        print(f"starting services (logs in {log_dir}) ...", file=sys.stderr, flush=True)
        services = Services.start(args.model, log_dir, worker_args)
        try:
            samples, bursts = asyncio.run(
                measure(
                    services,
                    prompts,
                    sizes,
                    transports,
                    args.burst,
                    args.burst_tokens,
                    args.repeats,
                )
            )
        finally:
            services.stop()
    print(report(samples, bursts, refs))
    if args.json is not None:
        saved = {
            "references": asdict(refs),
            "bursts": bursts,
            "samples": [asdict(x) for x in samples],
        }
        args.json.write_text(json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":  # the raw gRPC reference's sink runs as ``python -m`` this module
    sys.exit(main(sys.argv[1:]))
