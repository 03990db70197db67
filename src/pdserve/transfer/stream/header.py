"""The head of a layer stream, and what every sender checks of a hooked layer.

A stream is one ``StreamHeader`` (request id, layout, token count, compression) and then one
layer frame per layer, in any order (``frames.py``: the frame format, its sending and its
assembly).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pdserve.engine.kv_arrays import dtype_name
from pdserve.engine.kv_payload import KVLayout, kv_fingerprint
from pdserve.errors import KVPayloadMismatchError, KVTransferError
from pdserve.transfer.compress import Compression
from pdserve.transfer.handle import KVLocation, TransportKind

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

_HEADER_MAGIC = b"PDKVS1\n"


def check_layer(
    layout: KVLayout,
    num_tokens: int,
    layer: int,
    k: KVArray,
    v: KVArray,
    seen: Collection[int],
) -> None:
    """What every sender checks of a hooked layer: in range, new, and of the layout's shape."""
    if not 0 <= layer < layout.num_layers:
        raise KVTransferError(f"KV layer {layer} is outside [0, {layout.num_layers})")
    if layer in seen:
        raise KVTransferError(f"KV layer {layer} sent twice")
    shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
    for which, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape or dtype_name(t) != layout.dtype:
            raise KVPayloadMismatchError(
                f"layer {layer} {which} is {tuple(t.shape)} {dtype_name(t)}; "
                f"the layout needs {shape} {layout.dtype}"
            )


def missing_layers(layout: KVLayout, seen: Collection[int]) -> list[int]:
    return [i for i in range(layout.num_layers) if i not in seen]


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

    def location(
        self, kind: TransportKind, *, num_bytes: int, address: str, key: str, capability: bytes
    ) -> KVLocation:
        """Where this stream's hand-off lies once committed (``KVSender.planned``)."""
        return KVLocation(
            kind=kind,
            request_id=self.request_id,
            num_tokens=self.num_tokens,
            num_bytes=num_bytes,
            model_fingerprint=kv_fingerprint(self.layout),
            address=address,
            key=key,
            capability=capability,
        )

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


def read_header(data: bytes) -> StreamHeader:
    """The stream header a store entry carries, or ``KVTransferError``."""
    if not data:
        raise KVTransferError("KV entry has no stream header")
    return StreamHeader.decode(data)
