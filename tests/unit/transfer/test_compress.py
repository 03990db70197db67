"""int8 KV compression: the error bound, the size, and decoding from compressed KV."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.kv_arrays import dtype_name
from pdserve.engine.kv_payload import KVLayout
from pdserve.engine.kv_tensors import as_tensor
from pdserve.errors import InvalidArgumentError, KVPayloadMismatchError
from pdserve.transfer.compress import (
    BLOCK_TOKENS,
    QuantizedTensor,
    compress_payload,
    compression_ratio,
    decompress_payload,
    dequantize,
    measure_match_rate,
    quantize,
)
from tests.unit.transfer.conftest import make_layout, random_payload


def reference_scales(x: torch.Tensor) -> torch.Tensor:
    """absmax / 127 per (16-token block, head), computed block by block: [num_blocks, H]."""
    blocks = [x[i : i + BLOCK_TOKENS].float() for i in range(0, x.shape[0], BLOCK_TOKENS)]
    return torch.stack([b.abs().amax(dim=(0, 2)) for b in blocks]) / 127


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step(num_tokens: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    # Heads of very different magnitudes: each must get its own scale.
    x = (torch.randn(num_tokens, 3, 32, generator=g) * torch.tensor([0.01, 1.0, 50.0])[:, None]).to(
        dtype
    )
    q = quantize(x)
    scales = reference_scales(x)
    assert q.data.dtype == np.int8 and q.data.shape == x.shape
    torch.testing.assert_close(torch.from_numpy(q.scales), scales, rtol=0, atol=0)
    y = torch.from_numpy(dequantize(q, "float32"))
    per_elem = scales.repeat_interleave(BLOCK_TOKENS, dim=0)[:num_tokens, :, None]
    err = (y - x.float()).abs()
    # Half a step, plus fp32 rounding of the division and the product (a few ulps of |x|).
    fp32_slack = (x.float().abs() + y.abs()) * torch.finfo(torch.float32).eps
    assert bool((err <= per_elem / 2 + fp32_slack).all())
    # Back in the layout's dtype: the same, plus that dtype's own rounding of the result.
    # (numpy in the wire dtype: bfloat16 as its 2-byte words, viewed back here)
    wire = dequantize(q, str(dtype).removeprefix("torch."))
    assert wire.flags.c_contiguous
    back = as_tensor(wire, dtype)
    eps = torch.finfo(dtype).eps
    bound = per_elem / 2 + fp32_slack + y.abs() * eps
    assert bool(((back.float() - x.float()).abs() <= bound).all())


def test_zero_block_and_exact_extremes() -> None:
    x = torch.zeros(20, 2, 4)
    x[16:, 1] = torch.tensor([-3.0, 3.0, 1.5, 0.0])
    q = quantize(x)
    assert q.scales[0].tolist() == [0.0, 0.0] and q.scales[1, 0] == 0.0
    assert q.data[16, 1].tolist() == [-127, 127, 64, 0]  # 1.5 / (3/127) = 63.5 -> 64
    y = torch.from_numpy(dequantize(q, "float32"))
    assert torch.equal(y[:16], x[:16]) and y[16, 1, 0] == -3.0 and y[16, 1, 1] == 3.0


def test_wire_bytes_round_trip_and_size() -> None:
    x = torch.randn(40, 2, 8)
    q = quantize(x)
    data = q.to_bytes()
    # 40*2*8 int8 values + 3 blocks x 2 heads fp32 scales, counted independently.
    assert len(data) == q.nbytes == 40 * 2 * 8 + 3 * 2 * 4
    back = QuantizedTensor.from_bytes(data, 40, 2, 8)
    assert np.array_equal(back.data, q.data) and np.array_equal(back.scales, q.scales)
    with pytest.raises(KVPayloadMismatchError):
        QuantizedTensor.from_bytes(data[:-1], 40, 2, 8)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_size_is_about_half_of_bf16(head_dim: int) -> None:
    layout = KVLayout("fp", "bfloat16", 2, num_kv_heads=4, head_dim=head_dim, block_size=16)
    payload = random_payload(layout, 64)
    packed = compress_payload(payload)
    assert packed.nbytes / payload.nbytes == pytest.approx(0.5 + 1 / (8 * head_dim))
    assert compression_ratio(layout, 64) == pytest.approx(packed.nbytes / payload.nbytes)
    fp32 = KVLayout("fp", "float32", 2, num_kv_heads=4, head_dim=head_dim, block_size=16)
    assert compression_ratio(fp32, 64) == pytest.approx((0.5 + 1 / (8 * head_dim)) / 2)


def test_payload_round_trip_keeps_layout() -> None:
    payload = random_payload(make_layout("bfloat16", num_layers=3), 33)
    back = decompress_payload(compress_payload(payload))
    assert back.layout == payload.layout and back.num_tokens == 33
    for x, y in zip(back.keys + back.values, payload.keys + payload.values, strict=True):
        assert dtype_name(x) == dtype_name(y) == "bfloat16" and x.shape == y.shape


@pytest.mark.parametrize(
    "bad", [torch.zeros(0, 2, 4), torch.zeros(4, 8), torch.zeros(4, 2, 4, dtype=torch.int32)]
)
def test_quantize_validates(bad: torch.Tensor) -> None:
    with pytest.raises(InvalidArgumentError):
        quantize(bad)


def test_decoding_from_compressed_kv(tiny_llama_dir: Path) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (12, 40)]
    rate = measure_match_rate(tiny_llama_dir, prompts, 32, dtype="float32", num_kv_blocks=32)
    print(f"int8 KV greedy token match rate (tiny, float32, 2 prompts x 32 tokens): {rate:.3f}")
    assert 0.0 <= rate <= 1.0
    with pytest.raises(InvalidArgumentError):
        measure_match_rate(tiny_llama_dir, prompts, 0)
