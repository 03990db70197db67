"""References of ``pdserve bench transfer``, measured in the same run as the transports.

* memcpy: ``Tensor.copy_`` of a 256 MiB buffer, bytes of one copy per second (best of 5);
* loopback TCP: one socket on 127.0.0.1, a sender thread ``sendall`` 1 MiB pieces of 256 MiB,
  the receiver ``recv_into`` one buffer (best of 3);
* raw gRPC: the same bytes as a ``KVStore.Put`` stream into a servicer in another process
  that only counts them (grpcio, asyncio; best of 3; ``GrpcSink``).

Best, not median: a reference is what the machine can do. The ratios come from paired rounds
(``transfer_paired``): each hand-off between two measurements of its reference
(``paired_reference``: best of 3, raw gRPC of 2). ``References`` measured before and after
the run are reported beside them, as the machine's best.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.wire import Chunk, add_kvstore_servicer
from pdserve.rpc.server import build_server
from pdserve.service_process import ServiceProcess, terminate
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdserve_bench.transfer_paired import Reference

_MIB = 1024 * 1024


# -- references ----------------------------------------------------------------------------------
def memcpy_bytes_per_s(size: int = 256 * _MIB, repeats: int = 5) -> float:
    """One ``copy_`` of ``size`` bytes per second, best of ``repeats`` (first touch excluded)."""
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return size / min(times)


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
    return max(rates)


class _Sink(kvstore_pb2_grpc.KVStoreServicer):
    """A KVStore whose Put only counts bytes: gRPC's own cost, nothing of pdserve's."""

    async def Put(  # noqa: N802 - gRPC method names
        self, request_iterator: AsyncIterator[Chunk], context: object
    ) -> kvstore_pb2.PutResponse:
        n = 0
        async for chunk in request_iterator:
            n += len(chunk.data)
        return kvstore_pb2.PutResponse(num_bytes=n)


async def serve_sink(port_file: Path) -> None:
    """Serve the byte-counting sink; its port goes to ``port_file``."""
    server, port, health = build_server([(add_kvstore_servicer, _Sink())], port=0)
    await server.start()
    await health.set_serving()
    port_file.write_text(f"{port}\n")
    await server.wait_for_termination()


class GrpcSink:
    """The byte-counting sink (``serve_sink``) in its own process, for raw gRPC rates."""

    def __init__(self, log_dir: Path, wait: Callable[[list[ServiceProcess], float], None]) -> None:
        self.process = ServiceProcess(
            "grpc-sink", "pdserve_bench.transfer", ["--grpc-sink"],
            log_dir / "grpc-sink.port", log_dir / "grpc-sink.log",
        )  # fmt: skip
        self._wait = wait

    def __enter__(self) -> GrpcSink:
        self.process.spawn({**os.environ})
        try:
            self._wait([self.process], 60.0)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.process.proc is not None:
            terminate([self.process.proc], 5.0)

    def bytes_per_s(
        self, size: int = 256 * _MIB, repeats: int = 3, piece_bytes: int = _MIB
    ) -> float:
        """Raw gRPC (grpcio, asyncio): a Put stream of ``piece_bytes`` chunks into the sink,
        bytes per second (best of ``repeats``): what a transport on gRPC in Python can reach
        with messages of that size. Runs its own event loop: call it from a thread without
        one."""
        piece = os.urandom(piece_bytes)

        async def put() -> float:
            async with KVStoreClient(self.process.address) as client:

                async def pieces() -> AsyncIterator[tuple[bytes, int]]:
                    crc = zlib.crc32(piece)
                    for _ in range(size // piece_bytes):
                        yield piece, crc

                start = time.perf_counter()
                await client.put_stream("k", pieces())
                return size / (time.perf_counter() - start)

        return max(asyncio.run(put()) for _ in range(repeats))


@dataclass(frozen=True)
class References:
    """Bytes per second of the references, measured in the same run."""

    memcpy: float
    tcp: float
    grpc: float

    def summary(self) -> str:
        gb = 1e9
        return (
            f"memcpy {self.memcpy / gb:.2f} GB/s, loopback TCP {self.tcp / gb:.2f} GB/s, "
            f"raw gRPC {self.grpc / gb:.2f} GB/s"
        )

    @classmethod
    def measure(cls, sink: GrpcSink, size: int = 256 * _MIB) -> References:
        """All three now (a second or two for 256 MiB); no event loop may run in this thread."""
        return cls(memcpy_bytes_per_s(size), tcp_bytes_per_s(size), sink.bytes_per_s(size))

    def best(self, other: References) -> References:
        """Each reference's better measurement of the two."""
        return References(
            max(self.memcpy, other.memcpy), max(self.tcp, other.tcp), max(self.grpc, other.grpc)
        )


def paired_reference(sink: GrpcSink, size: int = 256 * _MIB) -> Reference:
    """The bracketing reference of a transport's hand-off (``transfer_paired.Reference``):
    memcpy for shm, loopback TCP and raw gRPC for the others. Blocking: call it in a thread."""

    def reference(transport: str) -> tuple[float, float]:
        if transport == "shm":
            return memcpy_bytes_per_s(size, repeats=3), 0.0
        return tcp_bytes_per_s(size, repeats=3), sink.bytes_per_s(size, repeats=2)

    return reference
