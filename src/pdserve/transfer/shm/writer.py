"""Same-host KV hand-off through a POSIX shared-memory segment (a file in ``/dev/shm``): the
writing side, ``SegmentWriter`` (``reader.py`` reads; ``handoff.py`` puts both behind the
transfer interface as ``ShmSender``/``ShmReceiver``).

The segment format is in ``segment.py``; its name, ``pdserve-kv-{owner_pid}-{request_id_hash}``,
in ``transfer.janitor``. Ownership: the sender's ``begin`` creates the segment and ``abort`` unlinks
it; once sealed (as its last layer is written, or by ``finish``), the receiver owns it and
unlinks it after reading, whatever the outcome. A segment whose owner died is reclaimed by
``janitor.reclaim_orphans``. Given a ``SlotPool``, the sender writes into a reused segment
(a slot, ``slots.py``) when one fits: it stays the writer's, mapped on both sides between
hand-offs, and the reader claims and then releases it instead of unlinking it.

Copies: the sender writes each layer once, straight from the engine's tensors into the mapping
(``Tensor.copy_`` into a view over it, device-to-host when the engine is on a GPU; on CPU,
when two threads share the layers, the one-pass copy of ``_hashcopy`` or numpy's) and hashes
K and V as it goes (``checksum.copy_and_hash``).
The receiver copies nothing: it unlinks the sealed segment, maps it privately, checks each
layer's checksum over the mapping and hands the engine views over it; the engine's import is
the one copy into its blocks.

Threads: given a ``pool`` (an ``Executor`` its creator owns and shuts down, e.g. the one of
the prefill worker's), the sender writes the layers in two lanes: every other layer goes
to a pool thread (up to ``_LANE_DEPTH`` in its hands) and the engine's thread goes on without
waiting for it, writing the next one itself; each layer's mark is published once it is done
(marks may appear out of order: a reader checks layers in order). The receiver hashes the
K's on a pool thread while its own does the V's: one core alone does not reach memory
bandwidth with a hash in the loop. Without one, everything runs on the calling thread (the
same checksums).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import secrets
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.kv_payload import DTYPES, KVLayout, KVPayload, kv_fingerprint
from pdserve.errors import (
    InvalidArgumentError,
    KVTransferError,
)
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    TransferState,
    TransportKind,
    advance,
)
from pdserve.transfer.janitor import SEGMENT_PREFIX, SHM_DIR, segment_name
from pdserve.transfer.shm import segment
from pdserve.transfer.shm.checksum import combine, copy_and_hash
from pdserve.transfer.shm.slots import Slot, SlotPool
from pdserve.transfer.stamp import CAPABILITY_BYTES
from pdserve.transfer.stream.header import check_layer, missing_layers

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

logger = logging.getLogger(__name__)

_LANE_DEPTH = 2
"""Layers the pool thread may have in hand: it keeps up, or the engine's thread takes over."""

_PIECE_BYTES = 1 << 20
"""Bytes copied then hashed at a time where the one-pass copy does not apply: small enough to
be hashed from cache (L2)."""


class _Mapper(threading.Thread):
    """Maps a new segment (or slot) for writing in the background
    (``segment.map_for_writing``)."""

    def __init__(
        self,
        fd: int,
        header: bytes,
        geom: segment.SegmentGeometry,
        slot: Slot | None,
        capability: bytes,
    ) -> None:
        super().__init__(name="shm-map", daemon=True)
        self._args = (fd, header, geom)
        self._slot = slot
        self._capability = capability
        self._mm: mmap.mmap | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            if self._slot is None:
                self._mm = segment.map_for_writing(*self._args, capability=self._capability)
            else:
                self._mm = segment.map_for_writing(
                    *self._args, capacity=self._slot.capacity, keep_fd=True,
                    generation=self._slot.generation, capability=self._capability,
                )  # fmt: skip
        except BaseException as err:  # handed to whoever joins: result() raises it
            self._error = err

    def result(self) -> mmap.mmap:
        """Wait for the mapping; raise what the mapping raised."""
        self.join()
        if self._error is not None:
            raise self._error
        if self._mm is None:
            raise KVTransferError("shm segment mapper ended without a mapping")
        return self._mm


def _log_failure(done: Future[None]) -> None:
    if (err := done.exception()) is not None:
        logger.warning("could not unmap a sealed shm segment: %r", err)


class SegmentWriter:
    """Prefill side: one segment per hand-off, written layer by layer from the layer hook."""

    kind = TransportKind.SHM

    def __init__(
        self,
        *,
        host: str | None = None,
        shm_dir: Path = SHM_DIR,
        prefix: str = SEGMENT_PREFIX,
        pool: Executor | None = None,
        closer: Executor | None = None,
        slots: SlotPool | None = None,
    ) -> None:
        self.host = host or socket.gethostname()
        self.shm_dir = shm_dir
        self.prefix = prefix
        self.pool = pool
        """Copies each layer's K beside the caller's V; None: the caller copies both."""
        self.closer = closer
        """Unmaps the segment once sealed (tearing down the page tables of a large segment
        takes ~40 ms per GB); None: the sealing thread unmaps it itself. Owned by
        the caller, who shuts it down (waiting) when done."""
        self.slots = slots
        """Reused segments (``slots.py``), kept mapped; None, or none free and no room for
        another: a one-off segment, unlinked by its reader."""
        self._slot: Slot | None = None
        self.state = TransferState.PENDING
        self.record = HandoffRecord(TransportKind.SHM.value)
        self.tamper: Callable[[np.ndarray], None] | None = None
        """Fault tests only: changes layer 0's bytes after they were hashed."""
        self.stalled = False
        """Fault tests only: the last layer does not seal the segment (a stalled writer)."""
        self.name = ""
        """The segment's name, once ``begin`` created it."""
        self.capability = b""
        """The hand-off's capability (``transfer.stamp``), chosen by ``begin``."""
        self._mm: mmap.mmap | None = None
        self._mapper: _Mapper | None = None
        self._geom = segment.SegmentGeometry(0, 0, 0)
        self._request_id = ""
        self._layout: KVLayout | None = None
        self._num_tokens = 0
        self._crcs: dict[int, int] = {}
        self._seen: set[int] = set()
        self._lane: deque[tuple[int, Future[int]]] = deque()
        """Layers given to the pool thread and not published yet, oldest first."""
        self._error: Exception | None = None
        self._sealed: tuple[int, ...] | None = None
        """The layer checksums, once the segment is sealed (with its last layer)."""

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        """Create and map the segment, sized for the header and every layer."""
        if self.state is not TransferState.PENDING:
            raise KVTransferError(f"begin on a sender that is {self.state.name}")
        if num_tokens < 1:
            raise InvalidArgumentError("num_tokens", f"must be >= 1, got {num_tokens}")
        if layout.dtype not in DTYPES:
            raise InvalidArgumentError("layout.dtype", f"unknown dtype {layout.dtype!r}")
        self.record.send_start_ns = time.monotonic_ns()
        header = KVPayload(layout, num_tokens, (), ()).header_bytes()
        geom = segment.SegmentGeometry.of(len(header), layout, num_tokens)
        self.capability = secrets.token_bytes(CAPABILITY_BYTES)
        try:
            name = self._reserve(request_id, header, geom)
        except BaseException:
            self.state = advance(self.state, TransferState.FAILED)
            raise
        self.name, self._geom, self._request_id = name, geom, request_id
        self._layout, self._num_tokens = layout, num_tokens
        self.record.num_bytes = geom.total
        self.state = advance(self.state, TransferState.SENDING)

    def _reserve(self, request_id: str, header: bytes, geom: segment.SegmentGeometry) -> str:
        """A mapped slot, started now; else a new slot or one-off segment, its mapping made
        beside the prefill's compute. The segment's name."""
        slot = self.slots.acquire(geom.total) if self.slots is not None else None
        if slot is not None and slot.mm is not None:
            segment.start(
                slot.mm, header, geom, flags=segment.FLAG_POOLED, generation=slot.generation,
                capability=self.capability,
            )  # fmt: skip
            self._slot, self._mm = slot, slot.mm
            return slot.name
        slot = self.slots.create(geom.total) if self.slots is not None else None
        if slot is not None:
            fd, name = slot.fd, slot.name
        else:
            name = segment_name(request_id, prefix=self.prefix)
            fd = segment.create(self.shm_dir / name)
        # Reserving, mapping and pre-faulting the segment run beside the prefill's compute;
        # the first layer waits for them (``_mapping``); a full /dev/shm fails that layer,
        # hence the commit. ``abort`` and ``finish`` join the mapper on every path.
        self._slot = slot
        self._mapper = _Mapper(fd, header, geom, slot, self.capability)
        self._mapper.start()
        return name

    def send_layer(self, layer: int, k: KVArray, v: KVArray) -> None:
        """Write one layer at its offset. Never raises: ``finish`` reports a failure."""
        start = time.monotonic_ns()
        if self._error is None:
            try:
                self._write_layer(layer, k, v)
            except Exception as err:  # raising here would fail the engine's whole batch
                # Drop the failed frame's locals: a tensor view over the mapping among them
                # would keep the mapping from closing.
                traceback.clear_frames(err.__traceback__)
                self._error = err
        self.record.hooked(start, time.monotonic_ns())

    def _mapping(self) -> mmap.mmap:
        """The segment's mapping, once the mapper thread has made it (or its error)."""
        if self._mm is None and self._mapper is not None:
            mapper, self._mapper = self._mapper, None
            self._mm = mapper.result()
            if self._slot is not None:
                self._slot.mm = self._mm  # the pool's from now on
        if self._mm is None:
            raise KVTransferError(f"shm segment {self.name!r} is not mapped")
        return self._mm

    def _write_layer(self, layer: int, k: KVArray, v: KVArray) -> None:
        if self.state is not TransferState.SENDING or self._layout is None:
            raise KVTransferError(f"send_layer on a sender that is {self.state.name}")
        mm = self._mapping()
        check_layer(self._layout, self._num_tokens, layer, k, v, self._seen)
        self._seen.add(layer)
        size, off = self._geom.layer_bytes, self._geom.layer_offset(layer)
        # A [layer_bytes] uint8 view over the mapping: K then V [num_tokens, kvh, hd] are
        # copied into it (the only copy: a gather, or device-to-host, straight into shm) and
        # hashed piece by piece as written. The hook's K and V are the engine's gathered
        # copies (``LayerHook``), so the pool thread may still read them after the call.
        dst = np.frombuffer(mm, dtype=np.uint8, count=size, offset=off)
        if self.pool is not None and len(self._lane) < _LANE_DEPTH and len(self._seen) % 2:
            # Every other layer to the pool thread; this thread goes on (the next layer, or
            # the engine's compute) without waiting for it.
            self._lane.append((layer, self.pool.submit(self._copy, layer, dst, k, v, False)))
        else:
            checksum = self._copy(layer, dst, k, v, self.pool is None)
            del dst
            self._publish(layer, checksum)
        self._collect(wait=False)
        if len(self._seen) == self._layout.num_layers and not self.stalled:
            # The last layer is in: seal now, not at ``finish``. A reader following the
            # writes (a prefetch) then holds the checked KV while the engine still ends its
            # step (the final norm, the logits, the sample), instead of after it.
            self._collect()
            self._seal()

    def _copy(self, layer: int, dst: np.ndarray, k: KVArray, v: KVArray, torch_copy: bool) -> int:
        """Copy and hash one layer into ``dst``; ``torch_copy``: with torch's intra-op threads
        (the only lane), else on this thread alone (numpy; two lanes run at once)."""
        half = dst.size // 2  # K then V, of one size
        checksum = combine(
            copy_and_hash(dst[:half], k, _PIECE_BYTES, torch_copy=torch_copy),
            copy_and_hash(dst[half:], v, _PIECE_BYTES, torch_copy=torch_copy),
        )
        if self.tamper is not None and not layer:  # fault tests: after the hash, before the mark
            self.tamper(dst)
        return checksum

    def _collect(self, *, wait: bool = True) -> None:
        """Publish the pool thread's finished layers, oldest first (``wait``: all of them);
        raises a layer's failure. A reader checks layers in order, whatever order their
        marks appear in."""
        while self._lane and (wait or self._lane[0][1].done()):
            layer, future = self._lane.popleft()
            self._publish(layer, future.result())

    def _settle(self) -> None:
        """Wait for the pool thread's layers, whatever their outcome (before unmapping)."""
        while self._lane:
            _, future = self._lane.popleft()
            future.exception()  # waits; an abort does not care why it failed

    def _publish(self, layer: int, checksum: int) -> None:
        self._crcs[layer] = checksum
        segment.mark_layer(self._mapping(), self._geom, layer, checksum)

    @property
    def checksums(self) -> tuple[int, ...]:
        """Each layer's checksum as sealed into the segment (empty until then)."""
        return self._sealed or ()

    def planned(self) -> KVLocation:
        """What ``finish`` will describe: for announcing the hand-off."""
        if self._layout is None:
            raise KVTransferError("planned() before begin()")
        return KVLocation(
            kind=TransportKind.SHM,
            request_id=self._request_id,
            num_tokens=self._num_tokens,
            num_bytes=self._geom.total,
            model_fingerprint=kv_fingerprint(self._layout),
            key=self.name,
            host=self.host,
            offset=0,
            length=self._geom.total,
            generation=self._slot.generation if self._slot is not None else 0,
            capability=self.capability,
        )

    def finish(self) -> KVLocation:
        """Seal the segment (unless its last layer did) and describe it; aborts (and raises)
        if a layer failed or is missing."""
        start = time.monotonic_ns()
        if self.state is not TransferState.SENDING or self._layout is None:
            raise KVTransferError(f"finish on a sender that is {self.state.name}")
        if self._error is None and self._sealed is None:
            try:
                self._mapping()
                self._collect()
            except Exception as failure:  # the mapper or the last pooled layer failed
                traceback.clear_frames(failure.__traceback__)
                self._error = failure
        if self._error is not None:
            err = self._error
            self.abort()
            raise KVTransferError(f"shm send of {self._request_id!r} failed: {err}") from err
        missing = missing_layers(self._layout, self._crcs)
        if missing:
            self.abort()
            raise KVTransferError(f"KV layers {missing} of {self._request_id!r} were never sent")
        if self._sealed is None:  # sealed with the last layer, unless it failed
            self._seal()
        self.state = advance(self.state, TransferState.SENT)
        end = time.monotonic_ns()
        self.record.hook_ns += end - start
        self.record.send_end_ns = end
        return self.planned()

    def _seal(self) -> tuple[int, ...]:
        """Seal the segment, every layer being in it (from then on the reader owns it), and
        let go of the mapping; the layer checksums."""
        if self._layout is None:
            raise KVTransferError("seal before begin")
        crcs = tuple(self._crcs[i] for i in range(self._layout.num_layers))
        mm = self._mapping()
        segment.touch(self.shm_dir / self.name)  # the janitor's clock starts at the hand-off
        segment.seal(mm, self._geom, crcs)
        self._mm, self._sealed = None, crcs
        if self._slot is not None and self.slots is not None:
            self.slots.sealed(self._slot)  # kept mapped, for the next hand-off
        elif self.closer is None:
            segment.close_mapping(mm)
        else:
            self.closer.submit(segment.close_mapping, mm).add_done_callback(_log_failure)
        return crcs

    def abort(self) -> None:
        """Unlink the segment (idempotent). After ``finish`` this revokes the hand-off."""
        if self.state is TransferState.FAILED:
            return
        self._settle()  # the pool thread may still be writing into the mapping
        if self._mapper is not None:
            mapper, self._mapper = self._mapper, None
            with contextlib.suppress(Exception):  # aborting: the mapping's outcome is moot
                self._mm = self._mm or mapper.result()
        if self._slot is not None and self.slots is not None:
            if self._slot.mm is None and self._mm is not None:
                self._slot.mm = self._mm
            self.slots.aborted(self._slot)  # marked ABORTED, or dropped if never mapped
            self._mm = None
            self.state = advance(self.state, TransferState.FAILED)
            return
        if self._mm is not None:
            segment.mark_aborted(self._mm)  # a reader following the writes stops at once
        segment.close_mapping(self._mm)
        self._mm = None
        if self.name:
            segment.unlink(self.shm_dir / self.name)
        self.state = advance(self.state, TransferState.FAILED)
