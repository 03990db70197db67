"""Optional int8 KV compression: symmetric absmax, one fp32 scale per (16-token block, head).

A layer's K (or V) ``[num_tokens, kv_heads, head_dim]`` in bf16/fp32 becomes int8 values of the
same shape plus fp32 scales ``[ceil(num_tokens / 16), kv_heads]``; ``scale = absmax / 127`` over
the block's 16 tokens x ``head_dim`` values of one head, ``q = round(x / scale)``. Dequantizing
(``q * scale``) is off by at most ``scale / 2`` per element (plus fp32 rounding). It runs in
numpy on the wire arrays (``engine.kv_arrays``; a torch tensor is viewed as one first), so a
process without torch compresses and decompresses too.

Size, exactly, for ``num_tokens`` a multiple of 16: ``T*H*D`` int8 bytes + ``(T/16)*H*4`` scale
bytes, so the ratio to bf16 (``2*T*H*D``) is ``1/2 + 1/(8*head_dim)``: 0.50391 at head_dim 32
(tiny preset), 0.50195 at 64 (small, base), 0.50098 at 128; to fp32 it is half of that. A
partial last block costs a whole block's scale (``compression_ratio`` gives the exact figure).

What it costs in output quality is measured, not assumed: ``measure_match_rate`` decodes the
same prompts greedily from the original and the round-tripped KV and reports the fraction of
matching tokens (numbers in ``docs/kv-transfer.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.engine.kv_arrays import from_float32, host_array, to_float32
from pdserve.engine.kv_payload import DTYPES, KVLayout, KVPayload
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError, KVPayloadMismatchError

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine
    from pdserve.engine.kv_arrays import KVArray

BLOCK_TOKENS = 16
"""Tokens that share one scale (per head)."""
_QMAX = 127  # symmetric: -128 is never produced, so negation is exact
_SCALE_DTYPE = np.dtype(np.float32)


class Compression(StrEnum):
    """How layer bytes are encoded on the wire (a stream-wide choice)."""

    NONE = "none"
    INT8 = "int8"


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """One int8-compressed ``[num_tokens, heads, head_dim]`` tensor."""

    data: np.ndarray
    """int8 ``[num_tokens, heads, head_dim]``."""
    scales: np.ndarray
    """fp32 ``[ceil(num_tokens / 16), heads]``."""

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes

    def to_bytes(self) -> bytes:
        """Scales (fp32, native little-endian) then the int8 values."""
        return (
            np.ascontiguousarray(self.scales).tobytes() + np.ascontiguousarray(self.data).tobytes()
        )

    @classmethod
    def from_bytes(
        cls, data: bytes | memoryview, num_tokens: int, heads: int, head_dim: int
    ) -> QuantizedTensor:
        expected = quantized_nbytes(num_tokens, heads, head_dim)
        if len(data) != expected:
            raise KVPayloadMismatchError(
                f"int8 KV block is {len(data)} bytes; {num_tokens} tokens x {heads} heads x "
                f"{head_dim} need {expected}"
            )
        num_blocks = -(-num_tokens // BLOCK_TOKENS)
        split = num_blocks * heads * _SCALE_DTYPE.itemsize
        raw = np.frombuffer(bytearray(data), dtype=np.uint8)
        scales = raw[:split].view(_SCALE_DTYPE).reshape(num_blocks, heads)
        values = raw[split:].view(np.int8).reshape(num_tokens, heads, head_dim)
        return cls(values, scales)


def quantized_nbytes(num_tokens: int, heads: int, head_dim: int) -> int:
    """Wire size of one quantized ``[num_tokens, heads, head_dim]`` tensor."""
    num_blocks = -(-num_tokens // BLOCK_TOKENS)
    return num_tokens * heads * head_dim + num_blocks * heads * _SCALE_DTYPE.itemsize


def compression_ratio(layout: KVLayout, num_tokens: int) -> float:
    """Compressed / uncompressed bytes of a payload of ``num_tokens`` tokens in ``layout``."""
    if num_tokens < 1:
        raise InvalidArgumentError("num_tokens", f"must be >= 1, got {num_tokens}")
    packed = quantized_nbytes(num_tokens, layout.num_kv_heads, layout.head_dim)
    plain = num_tokens * layout.num_kv_heads * layout.head_dim * DTYPES[layout.dtype].itemsize
    return packed / plain


def quantize(x: KVArray) -> QuantizedTensor:
    """``x`` ``[num_tokens, heads, head_dim]`` (a float or bfloat16-word array, or a tensor
    on any device) as int8 + scales."""
    a = host_array(x)
    if a.ndim != 3 or a.shape[0] < 1:
        raise InvalidArgumentError(
            "x", f"expected [num_tokens >= 1, heads, head_dim], got {tuple(a.shape)}"
        )
    if a.dtype != np.uint16 and not np.issubdtype(a.dtype, np.floating):
        raise InvalidArgumentError("x", f"expected a float tensor, got {x.dtype}")
    T, H, D = a.shape
    num_blocks = -(-T // BLOCK_TOKENS)
    blocks = np.zeros((num_blocks * BLOCK_TOKENS, H, D), dtype=np.float32)
    blocks[:T] = to_float32(a)  # zero tokens pad the last block: they change no absmax
    blocks = blocks.reshape(num_blocks, BLOCK_TOKENS, H, D)
    scales = np.abs(blocks).max(axis=(1, 3)) / np.float32(_QMAX)  # [num_blocks, H]
    # An all-zero block has scale 0; divide by 1 there (its values quantize to 0 either way).
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(blocks / safe[:, None, :, None]), -_QMAX, _QMAX).astype(np.int8)
    return QuantizedTensor(np.ascontiguousarray(q.reshape(-1, H, D)[:T]), scales)


def dequantize(q: QuantizedTensor, dtype: str) -> np.ndarray:
    """Back to ``[num_tokens, heads, head_dim]`` in the layout dtype ``dtype``'s wire dtype."""
    T = q.data.shape[0]
    per_token = np.repeat(q.scales, BLOCK_TOKENS, axis=0)[:T]  # [T, H]
    return from_float32(q.data.astype(np.float32) * per_token[:, :, None], dtype)


@dataclass(frozen=True, slots=True)
class CompressedKV:
    """A ``KVPayload`` with every layer's K and V quantized."""

    layout: KVLayout
    num_tokens: int
    keys: tuple[QuantizedTensor, ...]
    values: tuple[QuantizedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


def compress_payload(payload: KVPayload) -> CompressedKV:
    return CompressedKV(
        payload.layout,
        payload.num_tokens,
        tuple(quantize(k) for k in payload.keys),
        tuple(quantize(v) for v in payload.values),
    )


def decompress_payload(packed: CompressedKV) -> KVPayload:
    dtype = packed.layout.dtype
    return KVPayload(
        packed.layout,
        packed.num_tokens,
        tuple(dequantize(k, dtype) for k in packed.keys),
        tuple(dequantize(v, dtype) for v in packed.values),
    )


def measure_match_rate(
    model_dir: str | Path,
    prompts: Sequence[str | Sequence[int]],
    n_tokens: int,
    **engine_options: Any,
) -> float:
    """Greedy token match rate of decoding from int8-round-tripped KV vs. the original KV.

    Per prompt: prefill on engine A (``hold_kv``, first token only), export; import the
    original payload into engine B and decode ``n_tokens`` greedy tokens after the first; do
    the same from ``decompress_payload(compress_payload(payload))``. Returns matching positions
    / all positions (position-wise, so one early divergence costs the rest of that prompt).
    ``engine_options`` are ``EngineConfig`` fields for both engines.
    """
    # Imported here: the engine pulls in the model code, which the transfer path never needs.
    from pdserve.engine.engine import Engine

    if n_tokens < 1:
        raise InvalidArgumentError("n_tokens", f"must be >= 1, got {n_tokens}")
    if not prompts:
        raise InvalidArgumentError("prompts", "must not be empty")
    # Prefix caching off: the two imports of one prompt must not share (and overwrite) blocks.
    options: dict[str, Any] = {"kv_cache_bytes": 64 * 1024 * 1024, **engine_options}
    options["enable_prefix_caching"] = False
    prefill = Engine.from_pretrained(model_dir, **options)
    decode = Engine.from_pretrained(model_dir, **options)
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens + 1, ignore_eos=True)
    matched = total = 0
    for i, prompt in enumerate(prompts):
        first, payload = _prefill_export(prefill, f"p{i}", prompt, params)
        reference = _decode(decode, f"ref{i}", prompt, params, payload, first)
        trial = _decode(
            decode,
            f"int8-{i}",
            prompt,
            params,
            decompress_payload(compress_payload(payload)),
            first,
        )
        matched += sum(a == b for a, b in zip(reference, trial, strict=True))
        total += len(reference)
    return matched / total


def _prefill_export(
    engine: Engine, rid: str, prompt: str | Sequence[int], params: SamplingParams
) -> tuple[tuple[int, float], KVPayload]:
    engine.add_request(rid, prompt, params.first_token_only(), hold_kv=True)
    first: tuple[int, float] | None = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                first = (out.new_token_ids[0], out.new_logprobs[0])
    if first is None:
        raise RuntimeError(f"prefill of {rid!r} produced no token")
    payload = engine.export_kv(rid)
    engine.release_kv(rid)
    return first, payload


def _decode(
    engine: Engine,
    rid: str,
    prompt: str | Sequence[int],
    params: SamplingParams,
    payload: KVPayload,
    first: tuple[int, float],
) -> list[int]:
    """The greedy tokens decoded after ``first`` from an imported payload."""
    engine.add_request(rid, prompt, params, kv=payload, first_token=first)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens
