"""``shm`` behind the transfer interface: ``ShmSender`` (a ``KVSender`` over a
``SegmentWriter``) and ``ShmReceiver`` (a ``KVReceiver`` over a ``SegmentReader``).

Faults (``SendFaults``): a stall leaves the segment unsealed and lets the commit run into its
timeout; corrupt flips a byte of layer 0 after it was hashed (the reader must notice).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import KVTransferError
from pdserve.transfer.base import HandoffRecord, KVLocation, TransferState, TransportKind
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.janitor import parse_owner_pid
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.writer import SegmentWriter
from pdserve.transfer.stamp import holds_capability

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray


class ShmSender:
    """``shm``: one hand-off written into a segment (``SegmentWriter``) on this host."""

    kind = TransportKind.SHM

    def __init__(self, writer: SegmentWriter, *, faults: SendFaults | None = None) -> None:
        self.writer = writer
        self.record: HandoffRecord = writer.record
        self.faults = faults
        self._request_id = ""

    @property
    def state(self) -> TransferState:
        return self.writer.state

    @property
    def busy_ns(self) -> int:
        return self.record.hook_ns  # the copies into the segment, and the seal

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        self._request_id = request_id
        if self.faults is not None and self.faults.corrupts(request_id):
            self.writer.tamper = _flip_first_byte
        if self.faults is not None and self.faults.stalls(request_id):
            self.writer.stalled = True
        self.writer.begin(request_id, layout, num_tokens)

    def planned(self) -> KVLocation:
        return self.writer.planned()

    def send_layer(self, layer: int, k: KVArray, v: KVArray) -> None:
        self.writer.send_layer(layer, k, v)

    async def commit(self, timeout_s: float) -> KVLocation:
        if self.faults is not None and self.faults.stalls(self._request_id):
            await asyncio.sleep(timeout_s)  # the stalled writer: nothing seals the segment
            raise KVTransferError(f"shm hand-off not sealed within {timeout_s:.3g} s (stalled)")
        return self.writer.finish()  # seals the segment: a memory write, nothing to wait for

    async def discard(self) -> None:
        self.writer.abort()  # unlinks the segment (revokes it after a commit)


def _flip_first_byte(data: np.ndarray) -> None:
    data[0] ^= 0xFF


class ShmReceiver:
    """``shm``: the segment ``location`` names, read by a ``SegmentReader`` (which unlinks what
    it read).

    ``discard`` before any ``receive`` (the request was refused) unlinks the segment too, if
    its name is one of pdserve's segments, it lies on this host and it holds the handle's
    capability (a reused slot: frees the hand-off in it, ``SegmentReader.discard_slot``).
    """

    kind = TransportKind.SHM

    def __init__(self, reader: SegmentReader, location: KVLocation) -> None:
        self.reader = reader
        self.location = location
        self.record: HandoffRecord = reader.record
        self.compression = "none"
        self._started = False

    @property
    def state(self) -> TransferState:
        return self.reader.state

    async def receive(self, timeout_s: float) -> KVPayload:
        self._started = True
        return await self.reader.receive(self.location, timeout_s)

    async def discard(self) -> None:
        if self._started:
            self.reader.cleanup()
            return
        self._started = True
        name, host = self.location.key, self.location.host
        if host and host != self.reader.host:
            return  # another host's name: nothing of ours
        if parse_owner_pid(name) is None or "/" in name:
            return  # not a pdserve segment name: never unlink what came off the network
        path = self.reader.shm_dir / name
        capability = self.location.capability
        if self.location.generation:  # a reused slot: its writer's; free this hand-off
            self.reader.discard_slot(path, self.location.generation, capability)
            return
        if holds_capability(path, capability):  # a guessed name unlinks nothing
            path.unlink(missing_ok=True)
