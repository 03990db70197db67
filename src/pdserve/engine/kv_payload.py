"""The KV hand-off format: a self-describing copy of one sequence's prompt KV.

Lifecycle of a hand-off (the engine's side of disaggregation):
  1. The prefill engine runs a request with ``hold_kv=True``: after its first token the
     sequence finishes but keeps its blocks.
  2. ``Engine.export_kv`` copies the blocks into a ``KVPayload`` (token-major, per layer), or a
     transport streams layers as the ``layer_hook`` fires during the prefill.
  3. ``Engine.release_kv`` frees the prefill engine's blocks.
  4. The decode engine's ``add_request(..., kv=payload, first_token=...)`` checks the layout,
     copies the KV into its own blocks and continues decoding from the first token.

The payload is token-major (``[num_tokens, kv_heads, head_dim]`` per layer), so engines with
different block sizes can exchange it; model, dtype and head layout must match exactly. Its
arrays are ``kv_arrays.KVArray``: numpy in the wire dtype wherever a transport made them, a
torch engine's tensors where it exported them itself; this module imports no torch.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.kv_arrays import WIRE_DTYPES, from_buffer, host_array
from pdserve.errors import KVPayloadMismatchError

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

_MAGIC = b"PDKV1\n"
DTYPES = WIRE_DTYPES
"""The layout dtypes a payload may have, each with the numpy dtype its bytes travel in."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must agree between two engines for KV to move between them."""

    model_fingerprint: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ``KVPayloadMismatchError`` naming the first field that differs."""
        for name in ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise KVPayloadMismatchError(
                    f"KV payload {name} is {theirs!r} but this engine has {mine!r}"
                )


def kv_fingerprint(layout: KVLayout) -> str:
    """What must match between a KV writer and reader: the weights and the KV dtype.

    The block size is left out on purpose: payloads are token-major, so engines with different
    block sizes exchange them fine.
    """
    return f"{layout.model_fingerprint}-{layout.dtype}"


@dataclass(frozen=True, slots=True)
class KVPayload:
    """The prompt KV of one sequence, all layers."""

    layout: KVLayout
    num_tokens: int
    keys: tuple[KVArray, ...]
    """Per layer ``[num_tokens, num_kv_heads, head_dim]``, on CPU, contiguous."""
    values: tuple[KVArray, ...]
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    """Called (once) when the engine has imported the payload: the transport may then use
    the memory the views lie on again (a reused shm slot). Idempotent; None: nothing to do."""

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.layout.num_layers * self.layout.bytes_per_token_per_layer

    # -- wire format: header, then per layer K bytes and V bytes ---------------------------
    def header_bytes(self) -> bytes:
        meta = {"layout": asdict(self.layout), "num_tokens": self.num_tokens}
        return _MAGIC + json.dumps(meta, sort_keys=True).encode()

    def layer_bytes(self, layer: int) -> bytes:
        return tensor_bytes(self.keys[layer]) + tensor_bytes(self.values[layer])

    def to_bytes(self) -> bytes:
        """Header length (4 bytes), header, layers, CRC32 of everything before it."""
        header = self.header_bytes()
        body = b"".join(self.layer_bytes(i) for i in range(self.layout.num_layers))
        blob = len(header).to_bytes(4, "little") + header + body
        return blob + zlib.crc32(blob).to_bytes(4, "little")

    @classmethod
    def from_bytes(cls, blob: bytes) -> KVPayload:
        if len(blob) < 8 or zlib.crc32(blob[:-4]) != int.from_bytes(blob[-4:], "little"):
            raise KVPayloadMismatchError("KV payload checksum mismatch (corrupt or truncated)")
        hlen = int.from_bytes(blob[:4], "little")
        layout, num_tokens = parse_header(blob[4 : 4 + hlen])
        per_layer = num_tokens * layout.bytes_per_token_per_layer
        body = memoryview(blob)[4 + hlen : -4]
        if len(body) != per_layer * layout.num_layers:
            raise KVPayloadMismatchError(
                f"KV payload body is {len(body)} bytes, "
                f"header implies {per_layer * layout.num_layers}"
            )
        keys, values = [], []
        for i in range(layout.num_layers):
            k, v = split_layer(bytes(body[i * per_layer : (i + 1) * per_layer]), layout, num_tokens)
            keys.append(k)
            values.append(v)
        return cls(layout, num_tokens, tuple(keys), tuple(values))


def parse_header(header: bytes) -> tuple[KVLayout, int]:
    if not header.startswith(_MAGIC):
        raise KVPayloadMismatchError("not a pdserve KV payload (bad magic)")
    meta = json.loads(header[len(_MAGIC) :])
    layout = KVLayout(**meta["layout"])
    if layout.dtype not in DTYPES:
        raise KVPayloadMismatchError(f"KV payload dtype {layout.dtype!r} is unknown")
    return layout, int(meta["num_tokens"])


def tensor_bytes(t: KVArray) -> bytes:
    """The bytes of one layer's K (or V), in token-major order."""
    return np.ascontiguousarray(host_array(t)).tobytes()


def split_layer(data: bytes, layout: KVLayout, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's K and V from their wire bytes (writable copies)."""
    shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
    half = len(data) // 2
    k = from_buffer(bytearray(data[:half]), layout.dtype, shape)
    v = from_buffer(bytearray(data[half:]), layout.dtype, shape)
    return k, v
