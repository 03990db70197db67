"""Layer frames as the worker moves them: sent without a copy of their own, parsed with one.

A layer stream is a ``StreamHeader`` (``header.py``), then one frame per layer, in any order
(little-endian)::

    b"PDLF" | u32 layer | u64 len(K) | u64 len(V) | u32 crc32(K || V) | K bytes | V bytes

K and V are the layer's ``[num_tokens, kv_heads, head_dim]`` tensors as raw bytes in the
layout's dtype (``Compression.NONE``) or as ``QuantizedTensor.to_bytes`` (``INT8``). This is
the one implementation of the format (the ``stream`` and ``fake`` transports use it):

* ``LayerCopy.take`` (engine thread, inside the layer hook) keeps the hooked K and V (the
  engine's gathered copies; device-to-host on a GPU). ``LayerCopy.seal`` (the event loop for
  a small frame, the sealing thread for a large one: ``sender.py``) cuts them into
  chunk pieces (views), computing each piece's CRC-32 once; the frame's CRC is
  combined from those (``kvstore.crc``), and int8 compression happens here too. The frame's
  header travels in front of K's first piece, in the same chunk (``Chunk.lead``). The chunk
  codec (``kvstore.wire``) copies each piece, and that header, once, into the message gRPC
  sends.
* ``FrameCollector`` (receiving side) accepts the byte stream in pieces of any size. A
  received header-and-K piece and its V piece (each K and V within one chunk: up to 1024
  tokens of the base preset) are kept as they came, and K and V are tensors over them;
  otherwise each frame is copied once into a buffer of its own and viewed there. It checks
  the CRC (combined from the chunks' already checked CRCs when the pieces line up with the
  frame) and the sizes; int8 is dequantized. ``build()`` returns the ``KVPayload``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.kv_arrays import byte_view, contiguous, from_buffer
from pdserve.engine.kv_payload import DTYPES, KVLayout, KVPayload
from pdserve.errors import KVPayloadMismatchError, KVTransferError
from pdserve.kvstore.client import Piece
from pdserve.kvstore.crc import crc32_combine, fast_crc32
from pdserve.transfer.compress import (
    Compression,
    QuantizedTensor,
    dequantize,
    quantize,
    quantized_nbytes,
)
from pdserve.transfer.stream.header import StreamHeader

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

FRAME_HEAD = struct.Struct("<4sIQQI")
"""A frame's header (magic, layer, len K, len V, crc of K then V)."""
FRAME_MAGIC = b"PDLF"


def part_bytes(layout: KVLayout, num_tokens: int, compression: Compression) -> int:
    """Wire size of one layer's K (or V)."""
    if compression is Compression.INT8:
        return quantized_nbytes(num_tokens, layout.num_kv_heads, layout.head_dim)
    return num_tokens * layout.num_kv_heads * layout.head_dim * DTYPES[layout.dtype].itemsize


def frame_bytes(layout: KVLayout, num_tokens: int, compression: Compression) -> int:
    """Wire size of one layer's frame."""
    return FRAME_HEAD.size + 2 * part_bytes(layout, num_tokens, compression)


def stream_bytes(header: StreamHeader) -> int:
    """Header plus every frame: what a whole layer stream weighs."""
    n = header.layout.num_layers
    return len(header.encode()) + n * frame_bytes(
        header.layout, header.num_tokens, header.compression
    )


@dataclass(slots=True)
class LayerCopy:
    """One layer taken out of the engine: private copies of its K and V."""

    layer: int
    k: np.ndarray
    v: np.ndarray

    @classmethod
    def take(cls, layer: int, k: KVArray, v: KVArray) -> LayerCopy:
        """The hooked ``[num_tokens, kvh, hd]`` K and V as contiguous host arrays.

        They are the engine's gathered copies (``LayerHook``), viewed as they are when
        already contiguous on the host; else copied once (``kv_arrays.contiguous``: a gather
        from a strided view, or device-to-host on a GPU).
        """
        return cls(layer, contiguous(k), contiguous(v))

    def seal(
        self, piece_bytes: int, compression: Compression, *, corrupt: bool = False
    ) -> list[Piece]:
        """The frame as chunk pieces of K and V of at most ``piece_bytes`` each, with their
        CRC-32s, the frame's header travelling in front of the first one. Each byte is
        checksummed once: the frame's CRC is combined from the pieces'. ``corrupt`` flips a
        byte of K after that (fault tests).

        The header rides with K's first bytes rather than as a chunk of its own: a message
        costs grpcio a fixed ~0.25 ms here, whatever its size, which one 28-byte message per
        layer made a seventh of a 1K-token hand-off's time. It is the first piece's lead, not
        joined to it here: the chunk codec copies both straight into the message (measured,
        a joined copy of each frame's first MiB cost a 1K ``direct`` hand-off a tenth of its
        rate). Every piece is a view of the ``LayerCopy``'s arrays, which it keeps alive."""
        if compression is Compression.INT8:
            parts = [memoryview(quantize(t).to_bytes()) for t in (self.k, self.v)]
        else:
            parts = [byte_view(self.k), byte_view(self.v)]
        pieces: list[tuple[memoryview, int]] = []
        crc = 0  # CRC-32 of nothing
        for part in parts:
            for start in range(0, len(part), piece_bytes):
                data = part[start : start + piece_bytes]
                piece_crc = fast_crc32(data)
                crc = crc32_combine(crc, piece_crc, len(data))
                pieces.append((data, piece_crc))
        half = len(parts[0])
        head = FRAME_HEAD.pack(FRAME_MAGIC, self.layer, half, half, crc)
        if not pieces:  # an empty layer: the header alone
            return [(head, fast_crc32(head))]
        lead, lead_crc = pieces[0]
        if corrupt:
            # After the frame's CRC, before the chunk's: the store accepts it, the reader
            # must not. On a copy: the arrays may be the engine's.
            flipped = bytearray(lead)
            flipped[0] ^= 0xFF
            lead, lead_crc = memoryview(flipped), fast_crc32(flipped)
        first: Piece = (lead, crc32_combine(fast_crc32(head), lead_crc, len(lead)), head)
        return [first, *pieces[1:]]


def _frame_buffer(size: int) -> memoryview:
    """A writable buffer for one frame, not zero-filled first (it is overwritten whole): on
    multi-MB frames, ``bytearray``'s zeroing is one more pass over memory."""
    return np.empty(size, dtype=np.uint8).data.cast("B")


Kept = memoryview | np.ndarray
"""A received layer's K (or V): its bytes, viewed as an array by ``build()``; int8 ones are
dequantized at once (compute that overlaps the stream)."""


class FrameCollector:
    """Assembles one layer stream's frames from byte pieces of any size; see the module doc.

    ``expected_layout`` (the receiving engine's) is checked as soon as the header is in, so a
    payload from another model or dtype is refused before its data is parsed.
    """

    def __init__(self, header: StreamHeader, *, expected_layout: KVLayout | None = None) -> None:
        layout = header.layout
        if layout.dtype not in DTYPES:
            raise KVPayloadMismatchError(f"KV payload dtype {layout.dtype!r} is unknown")
        if header.num_tokens < 1:
            raise KVPayloadMismatchError(f"KV payload holds {header.num_tokens} tokens; need >= 1")
        if expected_layout is not None:
            expected_layout.check_compatible(layout)
        self.header = header
        self.part = part_bytes(layout, header.num_tokens, header.compression)
        self.frame_size = FRAME_HEAD.size + 2 * self.part
        self._shape = (header.num_tokens, layout.num_kv_heads, layout.head_dim)
        self._layers: dict[int, tuple[Kept, Kept]] = {}  # each checked layer's K and V
        self._frame: memoryview | None = None  # the frame being copied together
        self._filled = 0
        self._kv_crc: int | None = 0  # of the current frame's K/V so far; None: unknown
        self._lead: memoryview | None = None  # a frame's header and whole K, kept as received
        self._lead_crc = 0  # of the K bytes in ``_lead``
        self.frames: list[memoryview] = []
        """The complete frames' bytes in arrival order, as parts: a frame copied together,
        or a frame's header-and-K piece and its V piece kept as they came (K and V tensors
        are views over these)."""

    @property
    def complete(self) -> bool:
        return len(self._layers) == self.header.layout.num_layers

    def feed(self, data: bytes | bytearray | memoryview, crc32: int | None = None) -> None:
        """Take the next bytes of the stream (after the header).

        ``crc32``: the piece's CRC-32, already checked (a chunk's). When every piece of a
        frame's K and V came with one, the frame's CRC is combined from them instead of
        computed again.
        """
        view = memoryview(data).cast("B")
        if crc32 is not None and view.readonly and self._keep(view, crc32):
            return
        if self._lead is not None:
            self._copy_lead(self._lead)
        head = FRAME_HEAD.size
        if (
            crc32 is not None
            and self._filled >= head
            and self._filled + len(view) <= self.frame_size
        ):
            if self._kv_crc is not None:
                self._kv_crc = crc32_combine(self._kv_crc, crc32, len(view))
        elif crc32 is not None and self._filled == 0 and head < len(view) <= self.frame_size:
            # The header and the first K bytes in one piece (``LayerCopy.seal``): the CRC of
            # the K bytes is the piece's less the header's, shifted over them.
            self._kv_crc = crc32 ^ crc32_combine(fast_crc32(view[:head]), 0, len(view) - head)
        elif len(view) and not (self._filled == 0 and len(view) == head):
            self._kv_crc = None  # some K/V bytes came without a CRC: check the frame whole
        while len(view):
            if self._frame is None:
                self._frame = _frame_buffer(self.frame_size)
            frame = self._frame
            take = min(len(view), self.frame_size - self._filled)
            frame[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self.frame_size:
                self._frame, self._filled = None, 0
                k_end = head + self.part
                self._accept(frame[:head], frame[head:k_end], frame[k_end:], self._kv_crc, frame)
                self._kv_crc = 0
                if len(view):
                    self._kv_crc = None  # the rest spans another frame: no CRC for its part

    def _keep(self, view: memoryview, crc32: int) -> bool:
        """Take a piece that holds a frame's header and its whole K, or then its whole V,
        without a copy; False: it does not line up (``feed`` copies it).

        A layer of up to one chunk's size per K (1024 tokens of the base preset with 1 MiB
        chunks) travels as exactly these two pieces (``LayerCopy.seal``), so the frame is
        never copied together: measured, the endpoint's copy of each piece into its frame was
        about a tenth of a 1K ``direct`` hand-off's time. Only read-only pieces are kept (a
        received message's bytes, which nothing else holds or writes); the K and V tensors
        are read-only views over them (nothing writes into a
        received payload: the engine copies it into its blocks).
        """
        head = FRAME_HEAD.size
        if self._lead is None:
            if self._filled or len(view) != head + self.part:
                return False
            self._lead = view
            # The CRC of the K bytes: the piece's less the header's, shifted over them.
            self._lead_crc = crc32 ^ crc32_combine(fast_crc32(view[:head]), 0, self.part)
            return True
        if len(view) != self.part:
            return False
        lead, self._lead = self._lead, None
        kv_crc = crc32_combine(self._lead_crc, crc32, self.part)
        self._accept(lead[:head], lead[head:], view, kv_crc, lead, view)
        return True

    def _copy_lead(self, lead: memoryview) -> None:
        """A kept header-and-K piece whose V does not come whole: copy it into the frame
        buffer, as ``feed`` would have, and go on from there."""
        self._lead = None
        self._frame = frame = _frame_buffer(self.frame_size)
        frame[: len(lead)] = lead
        self._filled = len(lead)
        self._kv_crc = self._lead_crc

    def _accept(
        self,
        head: memoryview,
        keys: memoryview,
        values: memoryview,
        kv_crc: int | None,
        *parts: memoryview,
    ) -> None:
        """Check one frame (its header, K and V bytes) and keep K and V (``Kept``);
        ``parts``: the buffers they lie in, in stream order (``frames``)."""
        magic, layer, klen, vlen, crc = FRAME_HEAD.unpack_from(head)
        n = self.header.layout.num_layers
        if magic != FRAME_MAGIC:
            raise KVTransferError("not a KV layer frame (bad magic)")
        if klen != self.part or vlen != self.part:
            raise KVPayloadMismatchError(
                f"KV layer {layer} has K/V of {klen}/{vlen} bytes; the layout implies {self.part}"
            )
        if not 0 <= layer < n:
            raise KVTransferError(f"KV layer {layer} is outside [0, {n})")
        if layer in self._layers:
            raise KVTransferError(f"KV layer {layer} arrived twice")
        if kv_crc is None:
            kv_crc = fast_crc32(values, fast_crc32(keys))
        if kv_crc != crc:
            raise KVTransferError(f"KV layer {layer} failed its checksum")
        if self.header.compression is Compression.INT8:
            dtype = self.header.layout.dtype
            self._layers[layer] = (
                dequantize(QuantizedTensor.from_bytes(keys, *self._shape), dtype),
                dequantize(QuantizedTensor.from_bytes(values, *self._shape), dtype),
            )
        else:
            self._layers[layer] = (keys, values)
        self.frames.extend(parts)

    def build(self) -> KVPayload:
        """The payload; ``KVTransferError`` naming what is missing or left over."""
        n = self.header.layout.num_layers
        if self._filled or self._lead is not None:
            inside = self._filled + (len(self._lead) if self._lead is not None else 0)
            raise KVTransferError(f"KV stream ended inside a frame ({inside} bytes)")
        missing = [i for i in range(n) if i not in self._layers]
        if missing:
            raise KVTransferError(f"KV layers {missing} never arrived")
        # The views (over the buffers, which they keep alive: no further copy; a piece kept
        # as it came, ``_keep``, gives a read-only one) are made here, once the stream has
        # ended, not frame by frame while grpcio's threads compete for the GIL.
        dtype = self.header.layout.dtype

        def tensor(kept: Kept) -> np.ndarray:
            return from_buffer(kept, dtype, self._shape) if isinstance(kept, memoryview) else kept

        layers = [self._layers[i] for i in range(n)]
        return KVPayload(
            self.header.layout,
            self.header.num_tokens,
            tuple(tensor(k) for k, _ in layers),
            tuple(tensor(v) for _, v in layers),
        )
