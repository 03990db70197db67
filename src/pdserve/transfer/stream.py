"""Layer-wise framing of a KV payload, and its assembly on the receiving side.

A stream is one ``StreamHeader`` (request id, layout, token count, compression) and then one
``LayerFrame`` per layer, in any order. Frame wire format (little-endian)::

    b"PDLF" | u32 layer | u64 len(K) | u64 len(V) | u32 crc32(K || V) | K bytes | V bytes

K and V are the layer's ``[num_tokens, kv_heads, head_dim]`` tensors as raw bytes in the
layout's dtype (``Compression.NONE``) or as ``QuantizedTensor.to_bytes`` (``INT8``).
``PayloadAssembler`` checks every frame (checksum, size, range, repeats) and builds the
``KVPayload`` once all layers are in.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Collection
from dataclasses import asdict, dataclass

import torch

from pdserve.engine.kv_payload import DTYPES, KVLayout, KVPayload, tensor_bytes
from pdserve.errors import KVPayloadMismatchError, KVTransferError
from pdserve.transfer.compress import (
    Compression,
    QuantizedTensor,
    dequantize,
    quantize,
    quantized_nbytes,
)

_FRAME = struct.Struct("<4sIQQI")
_FRAME_MAGIC = b"PDLF"
_HEADER_MAGIC = b"PDKVS1\n"


def layer_crc(keys: bytes | memoryview, values: bytes | memoryview) -> int:
    """CRC-32 of K then V, without concatenating them."""
    return zlib.crc32(values, zlib.crc32(keys))


def check_layer(
    layout: KVLayout,
    num_tokens: int,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: Collection[int],
) -> None:
    """What every sender checks of a hooked layer: in range, new, and of the layout's shape."""
    if not 0 <= layer < layout.num_layers:
        raise KVTransferError(f"KV layer {layer} is outside [0, {layout.num_layers})")
    if layer in seen:
        raise KVTransferError(f"KV layer {layer} sent twice")
    shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
    dtype = DTYPES[layout.dtype]
    for which, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise KVPayloadMismatchError(
                f"layer {layer} {which} is {tuple(t.shape)} {t.dtype}; "
                f"the layout needs {shape} {dtype}"
            )


def missing_layers(layout: KVLayout, seen: Collection[int]) -> list[int]:
    return [i for i in range(layout.num_layers) if i not in seen]


@dataclass(frozen=True, slots=True)
class LayerFrame:
    """One layer's K and V bytes and their checksum."""

    layer: int
    keys: bytes
    values: bytes
    crc32: int

    @classmethod
    def from_tensors(
        cls,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        compression: Compression = Compression.NONE,
    ) -> LayerFrame:
        """Encode ``[num_tokens, kvh, hd]`` K and V (copies them: hook views may be kept)."""
        if compression is Compression.INT8:
            kb, vb = quantize(k).to_bytes(), quantize(v).to_bytes()
        else:
            kb, vb = tensor_bytes(k), tensor_bytes(v)
        return cls(layer, kb, vb, layer_crc(kb, vb))

    @property
    def checksum_ok(self) -> bool:
        return layer_crc(self.keys, self.values) == self.crc32

    def encode(self) -> bytes:
        head = _FRAME.pack(_FRAME_MAGIC, self.layer, len(self.keys), len(self.values), self.crc32)
        return head + self.keys + self.values

    @classmethod
    def decode(cls, data: bytes | memoryview) -> LayerFrame:
        """Parse one encoded frame (the checksum is checked by the assembler, not here)."""
        if len(data) < _FRAME.size:
            raise KVTransferError(f"KV layer frame truncated: {len(data)} bytes")
        magic, layer, klen, vlen, crc = _FRAME.unpack_from(data)
        if magic != _FRAME_MAGIC:
            raise KVTransferError("not a KV layer frame (bad magic)")
        if len(data) != _FRAME.size + klen + vlen:
            raise KVTransferError(
                f"KV layer frame {layer} is {len(data)} bytes; its header implies "
                f"{_FRAME.size + klen + vlen}"
            )
        view = memoryview(data)
        k_end = _FRAME.size + klen
        return cls(layer, bytes(view[_FRAME.size : k_end]), bytes(view[k_end:]), crc)


@dataclass(frozen=True, slots=True)
class StreamHeader:
    """What precedes the frames: which request, in what layout and encoding."""

    request_id: str
    layout: KVLayout
    num_tokens: int
    compression: Compression = Compression.NONE

    def encode(self) -> bytes:
        meta = {
            "request_id": self.request_id,
            "layout": asdict(self.layout),
            "num_tokens": self.num_tokens,
            "compression": self.compression.value,
        }
        return _HEADER_MAGIC + json.dumps(meta, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> StreamHeader:
        if not data.startswith(_HEADER_MAGIC):
            raise KVTransferError("not a KV stream header (bad magic)")
        try:
            meta = json.loads(data[len(_HEADER_MAGIC) :])
            layout = KVLayout(**meta["layout"])
            compression = Compression(meta["compression"])
            return cls(str(meta["request_id"]), layout, int(meta["num_tokens"]), compression)
        except (ValueError, KeyError, TypeError) as err:
            raise KVPayloadMismatchError(f"KV stream header unreadable: {err}") from err


class PayloadAssembler:
    """Collects the frames of one payload in any order and builds the ``KVPayload``.

    ``expected_layout`` (the receiving engine's) is checked up front, so a payload from another
    model or dtype is refused before any data moves.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_tokens: int,
        *,
        compression: Compression = Compression.NONE,
        expected_layout: KVLayout | None = None,
    ) -> None:
        if layout.dtype not in DTYPES:
            raise KVPayloadMismatchError(f"KV payload dtype {layout.dtype!r} is unknown")
        if num_tokens < 1:
            raise KVPayloadMismatchError(f"KV payload holds {num_tokens} tokens; need >= 1")
        if expected_layout is not None:
            expected_layout.check_compatible(layout)
        self.layout = layout
        self.num_tokens = num_tokens
        self.compression = compression
        self._shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
        self._frames: dict[int, LayerFrame] = {}

    @classmethod
    def from_header(
        cls, header: StreamHeader, *, expected_layout: KVLayout | None = None
    ) -> PayloadAssembler:
        return cls(
            header.layout,
            header.num_tokens,
            compression=header.compression,
            expected_layout=expected_layout,
        )

    @property
    def part_bytes(self) -> int:
        """Wire size of one layer's K (or V)."""
        T, H, D = self._shape
        if self.compression is Compression.INT8:
            return quantized_nbytes(T, H, D)
        return T * H * D * DTYPES[self.layout.dtype].itemsize

    def add(self, frame: LayerFrame) -> None:
        """Accept one frame; ``KVTransferError`` for a bad, repeated or out-of-range one."""
        n = self.layout.num_layers
        if not 0 <= frame.layer < n:
            raise KVTransferError(f"KV layer {frame.layer} is outside [0, {n})")
        if frame.layer in self._frames:
            raise KVTransferError(f"KV layer {frame.layer} arrived twice")
        if not frame.checksum_ok:
            raise KVTransferError(f"KV layer {frame.layer} failed its checksum")
        want = self.part_bytes
        if len(frame.keys) != want or len(frame.values) != want:
            raise KVPayloadMismatchError(
                f"KV layer {frame.layer} has K/V of {len(frame.keys)}/{len(frame.values)} "
                f"bytes; the layout implies {want} each"
            )
        self._frames[frame.layer] = frame

    def add_bytes(self, data: bytes | memoryview) -> None:
        self.add(LayerFrame.decode(data))

    def missing(self) -> list[int]:
        return [i for i in range(self.layout.num_layers) if i not in self._frames]

    @property
    def complete(self) -> bool:
        return len(self._frames) == self.layout.num_layers

    def build(self) -> KVPayload:
        """The payload; ``KVTransferError`` naming the missing layers if some never came."""
        missing = self.missing()
        if missing:
            raise KVTransferError(f"KV layers {missing} never arrived")
        frames = [self._frames[i] for i in range(self.layout.num_layers)]
        return KVPayload(
            self.layout,
            self.num_tokens,
            tuple(self._tensor(f.keys) for f in frames),
            tuple(self._tensor(f.values) for f in frames),
        )

    def _tensor(self, data: bytes) -> torch.Tensor:
        dtype = DTYPES[self.layout.dtype]
        if self.compression is Compression.INT8:
            return dequantize(QuantizedTensor.from_bytes(data, *self._shape), dtype)
        # bytearray: torch.frombuffer needs a writable buffer; the tensor keeps it alive.
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(dtype).view(self._shape)
