"""The engine's fast paths against slower, independent ones.

``test_parity.py`` checks the default engine (prepacked weights on CPU) against HF; this file
checks what that does not reach: the plain-weight path, torch's unmasked decode attention used
when every decoding sequence has the same context length, and the prepacked linear itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import dtype as dtype_module
from pdserve.engine.dtype import resolve_dtype
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models import linear as linear_module
from pdserve.models.linear import Linear, can_prepack
from tests.unit.engine.hf_reference import HFReference
from tests.unit.engine.test_parity import GREEDY, assert_matches_hf, prompts_of, run_collect

needs_prepack = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


def test_plain_weights_match_hf(tiny_qwen2_dir: Path) -> None:
    """Plain weights and torch's attention (the path CUDA takes) keep HF parity, biases
    included."""
    engine = Engine.from_pretrained(
        tiny_qwen2_dir,
        dtype="float32",
        return_logits=True,
        prepack_weights=False,
        attention_kernels=False,
    )
    ref = HFReference(tiny_qwen2_dir)
    prompts = prompts_of(engine, [1, 17, 40])
    got = run_collect(engine, prompts)
    for i, p in enumerate(prompts):
        assert_matches_hf(ref, p, *got[f"r{i}"])


def test_equal_length_batch_matches_hf(tiny_llama_dir: Path) -> None:
    """Sequences of one length decode together with no padding mask (torch's attention);
    still HF's tokens."""
    engine = Engine.from_pretrained(
        tiny_llama_dir, dtype="float32", return_logits=True, attention_kernels=False
    )
    ref = HFReference(tiny_llama_dir)
    prompts = prompts_of(engine, [20, 20, 20, 20], seed=3)
    got = run_collect(engine, prompts)
    for i, p in enumerate(prompts):
        assert_matches_hf(ref, p, *got[f"r{i}"])


@needs_prepack
def test_bf16_prepacked_matches_plain(tiny_llama_dir: Path) -> None:
    """In bfloat16 the packed kernels agree with ``F.linear`` up to bf16 rounding."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = [list(range(3, 200)), [5, 6, 7]]  # a multi-row prefill and a short one

    def first_logits(prepack: bool) -> list[torch.Tensor]:
        engine = Engine.from_pretrained(
            tiny_llama_dir, dtype="bfloat16", return_logits=True, prepack_weights=prepack
        )
        out = run_collect(engine, prompts, params)
        return [out[f"r{i}"][1][0] for i in range(len(prompts))]

    for packed, plain in zip(first_logits(True), first_logits(False), strict=True):
        torch.testing.assert_close(packed, plain, atol=0.05, rtol=0.02)


@needs_prepack
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_prepacked_linear_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU")
    g = torch.Generator().manual_seed(rows)
    layer = Linear(96, 40, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=g))
        layer.bias.copy_(torch.randn(40, generator=g))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(rows, 96, generator=g).to(dtype)
    layer.prepack(batch_hint=rows)
    assert layer.weight.numel() == 0, "the dense weight should be freed once packed"
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (0.1, 0.02)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=atol, rtol=rtol)


def test_no_prepack_off_cpu() -> None:
    assert not can_prepack(torch.device("cuda"), torch.bfloat16)
    assert not can_prepack(torch.device("cpu"), torch.float16)


def test_no_bf16_prepack_without_bf16_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN refuses to pack bf16 weights on a CPU without bf16 instructions (AVX2 only)."""
    monkeypatch.setattr(linear_module, "cpu_has_bf16_kernels", lambda: False)
    assert not can_prepack(torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("kernels", [False, True])
def test_auto_dtype_follows_the_cpus_bf16_kernels(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, kernels: bool
) -> None:
    """``auto`` is bfloat16 only where bf16 matmuls are native; the KV layout says the same."""
    monkeypatch.setattr(dtype_module, "cpu_has_bf16_kernels", lambda: kernels)
    # Plain weights: packing bf16 would need the kernels this test pretends are there.
    engine = Engine.from_pretrained(tiny_llama_dir, prepack_weights=False, num_kv_blocks=8)
    expected = torch.bfloat16 if kernels else torch.float32
    assert engine.dtype == expected
    assert engine.layout.dtype == str(expected).removeprefix("torch.")
    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"


def test_mixed_decode_and_prefill_step(tiny_llama_dir: Path) -> None:
    """A batch mixing a decode and a prompt chunk in one step matches each run alone."""
    engine = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    a, b = prompts_of(engine, [9, 33], seed=4)
    engine.add_request("a", a, GREEDY)
    engine.step()  # a prefilled; b joins while a decodes
    engine.add_request("b", b, GREEDY)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    alone_b = run_collect(engine, [b])["r0"][0]
    assert tokens["b"] == alone_b
