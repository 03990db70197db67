"""Layer frames as the worker moves them: sent without a copy of their own, parsed with one.

The wire format is ``pdserve.transfer.stream``'s (a ``StreamHeader``, then one ``LayerFrame``
per layer)::

    b"PDLF" | u32 layer | u64 len(K) | u64 len(V) | u32 crc32(K || V) | K bytes | V bytes

``stream.py`` builds frames from ``bytes`` objects; on multi-MB layers that means several
copies per side. Here:

* ``LayerCopy.take`` (engine thread, inside the layer hook) keeps the hooked K and V (the
  engine's gathered copies; device-to-host on a GPU). ``LayerCopy.seal`` (a worker thread)
  cuts them into chunk pieces (views), computing each piece's CRC-32 once; the frame's CRC is
  combined from those (``kvstore.crc``), and int8 compression happens here too. The frame's
  header travels in front of K's first piece (the one piece copied here). The chunk codec
  (``kvstore.wire``) copies each piece once, into the message gRPC sends.
* ``FrameCollector`` (receiving side) accepts the byte stream in pieces of any size, copies
  each frame once into a buffer of its own, checks the CRC and sizes there (combining the
  chunks' already checked CRCs when the pieces line up with the frame), and views K and V as
  tensors over that buffer (int8: dequantizes). ``build()`` returns the ``KVPayload``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.kv_payload import DTYPES, KVLayout, KVPayload
from pdserve.errors import KVPayloadMismatchError, KVTransferError
from pdserve.kvstore.crc import crc32_combine, fast_crc32
from pdserve.transfer.compress import (
    Compression,
    QuantizedTensor,
    dequantize,
    quantize,
    quantized_nbytes,
)
from pdserve.transfer.stream import StreamHeader

FRAME_HEAD = struct.Struct("<4sIQQI")
"""The ``LayerFrame`` header of ``pdserve.transfer.stream`` (magic, layer, len K, len V, crc)."""
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


Piece = tuple[bytes | memoryview, int]
"""Chunk data and its CRC-32 (``kvstore.client.Piece``)."""


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and t.is_contiguous():
        return t
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out


@dataclass(slots=True)
class LayerCopy:
    """One layer taken out of the engine: private copies of its K and V."""

    layer: int
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def take(cls, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerCopy:
        """The hooked ``[num_tokens, kvh, hd]`` K and V as contiguous CPU tensors.

        They are the engine's gathered copies (``LayerHook``), kept as they are when already
        contiguous on the CPU; else copied once (``copy_`` into uninitialised tensors: a
        gather from a strided view, or device-to-host on a GPU, no zero-filling first).
        """
        return cls(layer, _on_cpu(k), _on_cpu(v))

    def seal(
        self, piece_bytes: int, compression: Compression, *, corrupt: bool = False
    ) -> list[Piece]:
        """The frame as chunk pieces of K and V of at most ``piece_bytes`` each, with their
        CRC-32s, the frame's header travelling in front of the first one. Each byte is
        checksummed once: the frame's CRC is combined from the pieces'. ``corrupt`` flips a
        byte of K after that (fault tests).

        The header rides with K's first bytes rather than as a chunk of its own: a message
        costs grpcio a fixed ~0.25 ms here, whatever its size, which one 28-byte message per
        layer made a seventh of a 1K-token hand-off's time. That piece is the one copied here
        (numpy, outside the GIL), the others are views."""
        if compression is Compression.INT8:
            parts = [memoryview(quantize(t).to_bytes()) for t in (self.k, self.v)]
        else:
            parts = [_byte_view(self.k), _byte_view(self.v)]
        pieces: list[Piece] = []
        crc = 0  # CRC-32 of nothing
        for part in parts:
            for start in range(0, len(part), piece_bytes):
                # A view: the chunk codec copies it once, into the message gRPC sends (the
                # LayerCopy's tensors, which the view keeps alive, are this layer's own).
                data = part[start : start + piece_bytes]
                piece_crc = fast_crc32(data)
                crc = crc32_combine(crc, piece_crc, len(data))
                pieces.append((data, piece_crc))
        half = len(parts[0])
        head = FRAME_HEAD.pack(FRAME_MAGIC, self.layer, half, half, crc)
        if not pieces:  # an empty layer: the header alone
            return [(head, fast_crc32(head))]
        lead, lead_crc = pieces[0]
        first = np.empty(len(head) + len(lead), dtype=np.uint8)
        first[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        first[len(head) :] = np.frombuffer(lead, dtype=np.uint8)
        if corrupt:
            # After the frame's CRC, before the chunk's: the store accepts it, the reader
            # must not.
            first[len(head)] ^= 0xFF
            lead_crc = fast_crc32(first[len(head) :].data)
        pieces[0] = (first.data, crc32_combine(fast_crc32(head), lead_crc, len(lead)))
        return pieces


def _frame_buffer(size: int) -> memoryview:
    """A writable buffer for one frame, not zero-filled first (it is overwritten whole): on
    multi-MB frames, ``bytearray``'s zeroing is one more pass over memory."""
    return np.empty(size, dtype=np.uint8).data.cast("B")


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
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._frame = _frame_buffer(self.frame_size)
        self._filled = 0
        self._kv_crc: int | None = 0  # of the current frame's K/V so far; None: unknown
        self.frames: list[memoryview] = []
        """Every complete frame's bytes, in arrival order (K and V tensors are views)."""

    @property
    def complete(self) -> bool:
        return len(self._keys) == self.header.layout.num_layers

    def feed(self, data: bytes | bytearray | memoryview, crc32: int | None = None) -> None:
        """Take the next bytes of the stream (after the header).

        ``crc32``: the piece's CRC-32, already checked (a chunk's). When every piece of a
        frame's K and V came with one, the frame's CRC is combined from them instead of
        computed again.
        """
        view = memoryview(data).cast("B")
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
            take = min(len(view), self.frame_size - self._filled)
            self._frame[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self.frame_size:
                self._accept(self._frame, self._kv_crc)
                self._frame = _frame_buffer(self.frame_size)
                self._filled = 0
                self._kv_crc = 0
                if len(view):
                    self._kv_crc = None  # the rest spans another frame: no CRC for its part

    def _accept(self, frame: memoryview, kv_crc: int | None) -> None:
        magic, layer, klen, vlen, crc = FRAME_HEAD.unpack_from(frame)
        n = self.header.layout.num_layers
        if magic != FRAME_MAGIC:
            raise KVTransferError("not a KV layer frame (bad magic)")
        if klen != self.part or vlen != self.part:
            raise KVPayloadMismatchError(
                f"KV layer {layer} has K/V of {klen}/{vlen} bytes; the layout implies {self.part}"
            )
        if not 0 <= layer < n:
            raise KVTransferError(f"KV layer {layer} is outside [0, {n})")
        if layer in self._keys:
            raise KVTransferError(f"KV layer {layer} arrived twice")
        if kv_crc is None:
            with memoryview(frame) as view:
                kv_crc = fast_crc32(view[FRAME_HEAD.size :])
        if kv_crc != crc:
            raise KVTransferError(f"KV layer {layer} failed its checksum")
        k_off, v_off = FRAME_HEAD.size, FRAME_HEAD.size + self.part
        if self.header.compression is Compression.INT8:
            dtype = DTYPES[self.header.layout.dtype]
            with memoryview(frame) as view:
                k = dequantize(QuantizedTensor.from_bytes(view[k_off:v_off], *self._shape), dtype)
                v = dequantize(QuantizedTensor.from_bytes(view[v_off:], *self._shape), dtype)
        else:
            dtype = DTYPES[self.header.layout.dtype]
            k = self._view(frame, k_off, dtype)
            v = self._view(frame, v_off, dtype)
        self._keys[layer], self._values[layer] = k, v
        self.frames.append(frame)

    def _view(self, frame: memoryview, offset: int, dtype: torch.dtype) -> torch.Tensor:
        # A view over the frame buffer (which the tensor keeps alive): no further copy.
        raw = torch.frombuffer(frame, dtype=torch.uint8, count=self.part, offset=offset)
        return raw.view(dtype).view(self._shape)

    def build(self) -> KVPayload:
        """The payload; ``KVTransferError`` naming what is missing or left over."""
        n = self.header.layout.num_layers
        if self._filled:
            raise KVTransferError(f"KV stream ended inside a frame ({self._filled} bytes)")
        missing = [i for i in range(n) if i not in self._keys]
        if missing:
            raise KVTransferError(f"KV layers {missing} never arrived")
        return KVPayload(
            self.header.layout,
            self.header.num_tokens,
            tuple(self._keys[i] for i in range(n)),
            tuple(self._values[i] for i in range(n)),
        )


def read_header(data: bytes) -> StreamHeader:
    """The stream header a store entry carries, or ``KVTransferError``."""
    if not data:
        raise KVTransferError("KV entry has no stream header")
    return StreamHeader.decode(data)
