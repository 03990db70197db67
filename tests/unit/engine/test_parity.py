"""Greedy tokens and per-step logits match HF transformers on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.engine.model_runner import GROUP_OVERHEAD_TOKENS, length_groups
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from tests.unit.engine.hf_reference import HFReference

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ATOL = 2e-4


def prompts_of(engine: Engine, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_collect(
    engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    out: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        out[f"r{i}"] = ([], [])
    while engine.has_unfinished():
        step: list[RequestOutput] = engine.step()
        for o in step:
            out[o.request_id][0].extend(o.new_token_ids)
            if o.logits is not None:
                out[o.request_id][1].append(o.logits)
    engine.check_no_leaks()
    return out


def assert_matches_hf(
    ref: HFReference, prompt: list[int], tokens: list[int], logits: list[torch.Tensor]
) -> None:
    full = ref.logits(prompt + tokens)  # [len, vocab]
    expected = full[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    assert tokens == expected.argmax(-1).tolist()
    torch.testing.assert_close(torch.stack(logits), expected, atol=ATOL, rtol=1e-4)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_tied_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> HFReference:
    return HFReference(model_dir)


LENGTHS = [1, 5, 16, 17, 40, 77]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="batched"),
        pytest.param({"max_num_batched_tokens": 24, "max_num_seqs": 8}, id="chunked"),
        pytest.param(
            {"max_num_batched_tokens": 24, "max_num_seqs": 8, "enable_chunked_prefill": False},
            id="unchunked-small-budget",
        ),
        pytest.param({"num_kv_blocks": 14, "block_size": 8}, id="preemption"),
        # torch's SDPA path (the CUDA path, and the CPU fallback without the native kernels):
        # masked chunks after cached context, decode in length groups.
        pytest.param(
            {"max_num_batched_tokens": 24, "max_num_seqs": 8, "attention_kernels": False},
            id="chunked-torch-attention",
        ),
    ],
)
def test_batched_greedy_matches_hf(
    model_dir: Path, ref: HFReference, config: dict[str, object]
) -> None:
    engine = Engine.from_pretrained(model_dir, dtype="float32", return_logits=True, **config)
    prompts = prompts_of(engine, LENGTHS)
    got = run_collect(engine, prompts)
    for i, p in enumerate(prompts):
        tokens, logits = got[f"r{i}"]
        assert len(tokens) == GREEDY.max_tokens
        assert_matches_hf(ref, p, tokens, logits)
    if "num_kv_blocks" in config:
        assert engine.stats().num_preemptions > 0, "the pool was meant to be too small"


def test_alone_equals_batched(model_dir: Path) -> None:
    engine = Engine.from_pretrained(model_dir, dtype="float32")
    prompts = prompts_of(engine, LENGTHS, seed=1)
    batched = run_collect(engine, prompts)
    for i, p in enumerate(prompts):
        alone = run_collect(engine, [p])
        assert alone["r0"][0] == batched[f"r{i}"][0]


def test_prefix_cache_hits_match_hf(model_dir: Path, ref: HFReference) -> None:
    engine = Engine.from_pretrained(model_dir, dtype="float32", return_logits=True, block_size=8)
    shared = prompts_of(engine, [40], seed=2)[0]
    first = run_collect(engine, [[*shared, 7, 8, 9]])
    assert engine.stats().prefix_cache_hits == 0
    prompts = [[*shared, 11, 12], shared[:33], shared]
    engine.add_request("warm", [*shared, 7, 8, 9], GREEDY)
    cached: list[int] = []
    got: dict[str, tuple[list[int], list[torch.Tensor]]] = {"warm": ([], [])}
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, GREEDY)
        got[f"p{i}"] = ([], [])
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id][0].extend(o.new_token_ids)
            assert o.logits is not None
            got[o.request_id][1].append(o.logits)
            if o.finished:
                cached.append(o.num_cached_tokens)
    engine.check_no_leaks()
    assert got["warm"][0] == first["r0"][0]
    assert max(cached) >= 32, "the shared prefix should come from the cache"
    for i, p in enumerate(prompts):
        assert_matches_hf(ref, p, *got[f"p{i}"])


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        pytest.param("mistral", {"family": "mistral"}, id="mistral"),
        pytest.param(
            "llama3",
            {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0},
            id="llama3-rope-scaling",
        ),
        pytest.param(
            "llama3p",
            {"rope_scaling": LLAMA3_SCALING, "rope_style": "parameters"},
            id="rope-parameters-key",
        ),
        pytest.param("sharded", {"shards": 3}, id="sharded-safetensors"),
        pytest.param("llama-bias", {"attention_bias": True}, id="llama-attention-bias"),
    ],
)
def test_checkpoint_variants_match_hf(
    tmp_path_factory: pytest.TempPathFactory, name: str, overrides: dict[str, object]
) -> None:
    from pdserve.models.demo import init_checkpoint

    path = init_checkpoint(
        tmp_path_factory.mktemp(name), "tiny", dtype="float32", seed=5, **overrides
    )
    engine = Engine.from_pretrained(path, dtype="float32", return_logits=True)
    ref = HFReference(path)
    prompts = prompts_of(engine, [7, 90])  # 90 > original_max_position_embeddings: scaling matters
    got = run_collect(engine, prompts)
    for i, p in enumerate(prompts):
        assert_matches_hf(ref, p, *got[f"r{i}"])


@pytest.mark.gpu
def test_cuda_matches_cpu(tiny_llama_dir: Path) -> None:
    """The same code on CUDA: greedy tokens equal the CPU engine's, logits close."""
    cpu = Engine.from_pretrained(tiny_llama_dir, dtype="float32", return_logits=True)
    gpu = Engine.from_pretrained(tiny_llama_dir, dtype="float32", return_logits=True, device="cuda")
    prompts = prompts_of(cpu, LENGTHS)
    a, b = run_collect(cpu, prompts), run_collect(gpu, prompts)
    for rid in a:
        assert a[rid][0] == b[rid][0]
        torch.testing.assert_close(
            torch.stack(a[rid][1]), torch.stack(b[rid][1]), atol=1e-3, rtol=1e-3
        )
    ref = HFReference(tiny_llama_dir)
    for i, p in enumerate(prompts):
        assert_matches_hf(ref, p, *b[f"r{i}"])


@pytest.mark.parametrize("kernels", [False, True], ids=["torch-groups", "native"])
def test_decode_groups_match_hf(tiny_llama_dir: Path, kernels: bool) -> None:
    """Short contexts decoding beside a long one run as separate length groups (the long
    one's padding is not every row's) and still match HF token for token; the native kernel
    reads each sequence's own blocks."""
    ref = HFReference(tiny_llama_dir)
    engine = Engine.from_pretrained(
        tiny_llama_dir, dtype="float32", return_logits=True, attention_kernels=kernels
    )
    prompts = prompts_of(engine, [3, 9, 400, 420], seed=2)
    assert len(length_groups([3 + 1, 9 + 1, 400 + 1, 420 + 1])) == 2
    got = run_collect(engine, prompts)
    for i, p in enumerate(prompts):
        tokens, logits = got[f"r{i}"]
        assert len(tokens) == GREEDY.max_tokens
        assert_matches_hf(ref, p, tokens, logits)


@pytest.mark.parametrize(
    ("lengths", "expected"),
    [
        ([], []),
        ([5], [(0, 1)]),
        ([10, 10, 10], [(0, 3)]),
        # Padding under the fixed cost of a group stays one group.
        ([100, 150, 200, 250], [(0, 4)]),
        # One long context among short ones is its own group.
        ([100, 110, 120, 2400], [(0, 3), (3, 4)]),
        ([50] * 8 + [1000, 1100, 2400], [(0, 8), (8, 10), (10, 11)]),
    ],
)
def test_length_groups(lengths: list[int], expected: list[tuple[int, int]]) -> None:
    groups = length_groups(lengths)
    assert groups == expected
    # The groups tile the rows, and no group pads more than its fixed cost or half its keys.
    assert [i for a, b in groups for i in range(a, b)] == list(range(len(lengths)))
    for a, b in groups:
        run = lengths[a:b]
        padding = len(run) * run[-1] - sum(run)
        assert padding <= max(GROUP_OVERHEAD_TOKENS, sum(run) // 2)


def test_length_groups_need_ascending_lengths() -> None:
    with pytest.raises(ValueError, match="ascending"):
        length_groups([10, 5])
