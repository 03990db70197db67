"""The native CPU attention kernels (``pdserve.models.cpu_attention``) against a float64
reference on random inputs, over many shapes, in each build (portable, AVX2, AVX512-BF16) this
machine can run; and checks that the engine really runs them when they are built."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pdserve.cpuinfo import cpu_flags
from pdserve.engine.engine import Engine
from pdserve.errors import InvalidArgumentError
from pdserve.models import cpu_attention
from tests.unit.engine.test_parity import GREEDY, prompts_of, run_collect

MODELS_DIR = Path(cpu_attention.__file__).parent
BUILT = sorted(p.name.partition(".")[0] for p in MODELS_DIR.glob("_attention*.so"))
"""The builds present next to the module (none where the install had no compiler)."""

needs_native = pytest.mark.skipif(
    not cpu_attention.NATIVE_MODULE, reason="native attention kernels not built (no compiler)"
)


def _runnable_builds() -> list[str]:
    """The builds present that this CPU can run, the loader's preferred one first."""
    flags = cpu_flags()
    needs = {
        "_attention_avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
        "_attention_avx2": {"avx2", "fma"},
        "_attention": set(),
    }
    return [b for b, need in needs.items() if b in BUILT and need <= flags]


@pytest.fixture(params=_runnable_builds() or [pytest.param("", marks=needs_native)])
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Each build this CPU can run, swapped in behind the public functions."""
    module = importlib.import_module(f"pdserve.models.{request.param}")
    monkeypatch.setattr(cpu_attention, "_native", module)
    return module


def test_preferred_build_is_loaded() -> None:
    """A build that is present must import: a broken one must not silently leave torch's path."""
    if not BUILT:
        pytest.skip("native attention kernels not built (no compiler)")
    expected = _runnable_builds()[0]
    assert expected == cpu_attention.NATIVE_MODULE
    if expected == "_attention_avx512bf16":
        assert cpu_attention.bf16_dot_head_dims() == {32, 64, 96, 128}


@needs_native
def test_kernels_share_torchs_openmp_runtime() -> None:
    """The module binds to the OpenMP runtime torch loaded: the process maps one, not two."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps")
    q = torch.randn(64, 8, 64)
    kv = torch.randn(64, 4, 64)
    cpu_attention.prefill(q, kv, kv, 0.125)  # runs a parallel region
    runtimes = {
        line.split()[-1]
        for line in maps.read_text().splitlines()
        if any(name in line.rsplit("/", 1)[-1] for name in ("libgomp", "libiomp", "libomp"))
    }
    assert len(runtimes) <= 1, runtimes


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal GQA attention of the last n positions: q [n, nh, hd], k/v [ctx, kvh, hd]."""
    n, nh, _ = q.shape
    ctx, kvh = k.shape[0], k.shape[1]
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd = kd.repeat_interleave(nh // kvh, dim=1)  # query head h reads KV head h // group
    vd = vd.repeat_interleave(nh // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)


def _torch_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's own bf16 SDPA on the same inputs: the error budget the kernels must meet."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return o[0].transpose(0, 1)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, budget: torch.Tensor | None) -> None:
    """float32: to 1e-5. bf16: within 1.5x the error of torch's bf16 kernel (plus one bf16
    ulp of slack), and no bias: the mean error stays at rounding level."""
    err = (got.double() - ref).abs()
    if budget is None:
        assert err.max().item() < 1e-5, err.max().item()
        return
    torch_err = (budget.double() - ref).abs()
    assert err.max().item() <= 1.5 * torch_err.max().item() + 2**-8, (err.max(), torch_err.max())
    assert err.mean().item() <= 2 * torch_err.mean().item() + 1e-4, (err.mean(), torch_err.mean())


PREFILL_SHAPES = [
    # n, ctx, num_heads, num_kv_heads, head_dim
    (1, 1, 4, 2, 64),
    (7, 7, 8, 4, 64),
    (31, 31, 8, 8, 64),
    (33, 33, 8, 4, 64),
    (100, 100, 8, 1, 64),
    (129, 129, 8, 2, 128),
    (17, 50, 8, 4, 64),  # a chunk after cached context: offset causal mask
    (64, 300, 8, 2, 128),
    (1, 45, 4, 4, 64),  # one query over a longer context
    (70, 70, 6, 2, 96),
    (40, 77, 12, 4, 80),  # head_dim without a dot-product kernel: portable code
    (130, 130, 4, 4, 32),
    (9, 9, 64, 1, 64),  # 64 query heads on one KV head
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prefill_matches_reference(
    build: ModuleType, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    n, ctx, nh, kvh, hd = shape
    g = torch.Generator().manual_seed(sum(shape))
    # q, k, v as strided views of one fused projection, as the model passes them.
    qkv = (torch.randn(ctx, (nh + 2 * kvh) * hd, generator=g) * 1.5).to(dtype)
    q = qkv[ctx - n :, : nh * hd].view(n, nh, hd)
    k = qkv[:, nh * hd : (nh + kvh) * hd].view(ctx, kvh, hd)
    v = qkv[:, (nh + kvh) * hd :].view(ctx, kvh, hd)
    scale = hd**-0.5
    got = cpu_attention.prefill(q, k, v, scale)
    assert got.shape == (n, nh, hd) and got.dtype == dtype
    ref = _reference(q, k, v, scale)
    _assert_close(got, ref, _torch_bf16(q, k, v, scale) if dtype == torch.bfloat16 else None)


def _scatter(
    caches: tuple[torch.Tensor, torch.Tensor],
    kv: tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
) -> None:
    """Write ``[ctx, kvh, hd]`` K and V into the cache blocks of ``table``; the unused tail of
    the last block is left as it was (garbage, as in the engine)."""
    block_size = caches[0].shape[1]
    ctx = kv[0].shape[0]
    for cache, rows in zip(caches, kv, strict=True):
        flat = cache[table].view(-1, *rows.shape[1:])
        flat[:ctx] = rows
        cache[table] = flat.view(-1, block_size, *rows.shape[1:])


def _garbage_cache(
    num_blocks: int, block_size: int, kvh: int, hd: int, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches full of NaN and large values: any slot read by mistake shows."""
    shape = (num_blocks, block_size, kvh, hd)
    k = (torch.randn(shape, generator=g) * 1e4).to(dtype)
    v = torch.full(shape, float("nan"), dtype=dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize(("n", "ctx"), [(1, 1), (5, 40), (33, 33), (20, 161)])
def test_prefill_paged_matches_reference(
    build: ModuleType, n: int, ctx: int, block_size: int, dtype: torch.dtype
) -> None:
    nh, kvh, hd = 8, 4, 64
    g = torch.Generator().manual_seed(ctx * 31 + block_size)
    k = torch.randn(ctx, kvh, hd, generator=g).to(dtype)
    v = torch.randn(ctx, kvh, hd, generator=g).to(dtype)
    q = torch.randn(n, nh, hd, generator=g).to(dtype)
    nb = -(-ctx // block_size)
    caches = _garbage_cache(2 * nb + 3, block_size, kvh, hd, dtype, g)
    table = torch.randperm(2 * nb + 3, generator=g)[:nb]
    _scatter(caches, (k, v), table)
    got = cpu_attention.prefill_paged(q, caches[0], caches[1], table, ctx, 0.125)
    ref = _reference(q, k, v, 0.125)
    _assert_close(got, ref, _torch_bf16(q, k, v, 0.125) if dtype == torch.bfloat16 else None)


DECODE_CASES = [
    # batch, num_heads, num_kv_heads, head_dim, block_size, longest context
    (1, 4, 2, 64, 16, 1),
    (1, 8, 4, 64, 16, 2048),  # split across threads, then merged
    (3, 8, 4, 64, 16, 300),
    (4, 8, 2, 128, 16, 1000),
    (5, 6, 2, 96, 32, 600),
    (2, 12, 4, 80, 16, 70),
    (7, 4, 4, 32, 1, 40),
    (16, 8, 8, 64, 8, 257),
    (33, 8, 4, 64, 16, 100),
    (9, 64, 1, 64, 4, 20),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "x".join(map(str, c)))
def test_decode_matches_reference(
    build: ModuleType, case: tuple[int, ...], dtype: torch.dtype
) -> None:
    D, nh, kvh, hd, bs, longest = case
    g = torch.Generator().manual_seed(sum(case))
    lens = torch.randint(1, longest + 1, (D,), generator=g)
    lens[0] = longest
    width = -(-longest // bs)
    num_blocks = D * width + 5
    caches = _garbage_cache(num_blocks, bs, kvh, hd, dtype, g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables: list[int] = []  # the sequences' tables back to back, each from its own offset
    starts: list[int] = []
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for s in range(D):
        nb = -(-int(lens[s]) // bs)
        starts.append(len(tables))
        blocks = order[s * width : s * width + nb]
        tables.extend(blocks)
        rows = tuple(torch.randn(int(lens[s]), kvh, hd, generator=g).to(dtype) for _ in "kv")
        _scatter(caches, rows, torch.tensor(blocks))
        kv.append(rows)
    # Rows of q strided, as a view into the fused projection.
    q = torch.randn(D, nh + 2 * kvh, hd, generator=g).to(dtype)[:, :nh]
    scale = hd**-0.5
    got = cpu_attention.decode(
        q, caches[0], caches[1], torch.tensor(tables), torch.tensor(starts), lens, scale
    )
    assert got.shape == (D, nh, hd)
    for s in range(D):
        ref = _reference(q[s : s + 1], *kv[s], scale)
        budget = _torch_bf16(q[s : s + 1], *kv[s], scale) if dtype == torch.bfloat16 else None
        _assert_close(got[s : s + 1], ref, budget)


def test_decode_writes_into_out(build: ModuleType) -> None:
    """``out=`` receives the result in place, and tables may overlap or sit anywhere."""
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = (torch.randn(4, 16, 2, 64, generator=g) for _ in "kv")
    q = torch.randn(2, 4, 64, generator=g)
    tables, starts = torch.tensor([9, 0, 1, 2, 3]), torch.tensor([1, 3])
    lens = torch.tensor([20, 32])
    out = torch.full((3, 4, 64), 7.0)
    cpu_attention.decode(q, k_cache, v_cache, tables, starts, lens, 0.125, out=out[1:])
    alone = [
        cpu_attention.decode(
            q[i : i + 1], k_cache, v_cache, t, torch.tensor([0]), lens[i : i + 1], 0.125
        )
        for i, t in enumerate([torch.tensor([0, 1]), torch.tensor([2, 3])])
    ]
    torch.testing.assert_close(out[1:], torch.cat(alone))
    assert bool((out[0] == 7.0).all())


@needs_native
def test_bad_inputs_are_refused() -> None:
    """Shapes, dtypes and table entries are checked before any memory is read."""
    k_cache = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(1, 4, 64)
    tables, starts, lens = torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([20])
    with pytest.raises(InvalidArgumentError, match="k_cache"):  # q's dtype is the model's
        cpu_attention.decode(q.bfloat16(), k_cache, k_cache, tables, starts, lens, 0.1)
    with pytest.raises(InvalidArgumentError, match="q"):
        cpu_attention.decode(q.transpose(1, 2), k_cache, k_cache, tables, starts, lens, 0.1)
    with pytest.raises(InvalidArgumentError, match="block_tables"):
        cpu_attention.decode(q, k_cache, k_cache, tables.int(), starts, lens, 0.1)
    with pytest.raises(ValueError, match="out of range"):
        cpu_attention.decode(q, k_cache, k_cache, torch.tensor([0, 4]), starts, lens, 0.1)
    with pytest.raises(ValueError, match="past the 2 table entries"):
        cpu_attention.decode(q, k_cache, k_cache, tables, starts, torch.tensor([33]), 0.1)
    with pytest.raises(ValueError, match="past the 2 table entries"):
        cpu_attention.decode(q, k_cache, k_cache, tables, torch.tensor([1]), lens, 0.1)
    with pytest.raises(ValueError, match="n <= ctx"):
        three, two = torch.zeros(3, 4, 64), torch.zeros(2, 2, 64)
        cpu_attention.prefill(three, two, two, 0.1)
    with pytest.raises(InvalidArgumentError, match="block_table"):
        cpu_attention.prefill_paged(q, k_cache, k_cache, torch.tensor([0]), 17, 0.1)


def test_which_passes_take_the_kernels() -> None:
    cpu = torch.device("cpu")
    assert cpu_attention.kernels_for(torch.device("cuda"), torch.bfloat16, 8, 4, 64) == (
        cpu_attention.NONE
    )
    assert cpu_attention.kernels_for(cpu, torch.float16, 8, 4, 64) == cpu_attention.NONE
    assert cpu_attention.kernels_for(cpu, torch.float32, 8, 3, 64) == cpu_attention.NONE
    got = cpu_attention.kernels_for(cpu, torch.bfloat16, 8, 4, 64)
    # Decode wherever a build loaded; prefill only in the AVX512-BF16 build.
    assert got.decode == bool(cpu_attention.NATIVE_MODULE)
    assert got.prefill == (cpu_attention.NATIVE_MODULE == "_attention_avx512bf16")


# --- the engine on the kernels --------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_runs_the_kernels(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """With the kernels built, the engine's attention goes through them: decode, and (in the
    AVX512-BF16 build) whole prompts and chunks after cached context (chunked prefill and
    prefix-cache hits); with ``attention_kernels=False`` none does. The same tokens come out
    either way (float32)."""
    calls = {"prefill": 0, "prefill_paged": 0, "decode": 0}
    for name in calls:
        real = getattr(cpu_attention, name)

        def counted(*args: object, _real: object = real, _name: str = name, **kw: object) -> object:
            calls[_name] += 1
            return _real(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(cpu_attention, name, counted)

    def run(kernels: bool) -> dict[str, list[int]]:
        engine = Engine.from_pretrained(
            tiny_llama_dir, dtype=dtype, max_num_batched_tokens=48, max_num_seqs=4,
            block_size=8, attention_kernels=kernels,
        )  # fmt: skip
        native = engine.runner.native
        assert native == (
            cpu_attention.kernels_for(torch.device("cpu"), engine.dtype, 4, 2, 32)
            if kernels
            else cpu_attention.NONE
        )
        prompts = prompts_of(engine, [5, 30, 100], seed=9)
        prompts.append([*prompts[2][:64], 3, 4])  # shares 8 full blocks with the 100-token one
        out = run_collect(engine, prompts[:3])
        out.update({"again": run_collect(engine, prompts[3:])["r0"]})
        assert engine.stats().prefix_cache_hits > 0
        return {rid: tokens for rid, (tokens, _) in out.items()}

    native = run(True)
    layers = 4  # the tiny preset
    assert calls["decode"] >= layers * (GREEDY.max_tokens - 1)
    if cpu_attention.NATIVE_MODULE == "_attention_avx512bf16":  # prefill too (see kernels_for)
        assert calls["prefill"] > 0 and calls["prefill_paged"] > 0, calls
    else:
        assert calls["prefill"] == calls["prefill_paged"] == 0, calls
    before = dict(calls)
    torch_path = run(False)
    assert calls == before, "attention_kernels=False must not call the kernels"
    if dtype == "float32":
        assert native == torch_path
