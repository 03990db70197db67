"""Demo checkpoints: HF transformers loads them, greedy output varies, files are deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.cli import main as cli_main
from pdserve.models.demo import build_config, init_checkpoint, parameter_count

transformers = pytest.importorskip("transformers")

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over", "今天天气很好 我们"]


def _hf_model(path: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    # Every parameter must come from the file: a name mismatch would leave a random init.
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    return model.eval()


def _greedy(model: torch.nn.Module, tokenizer: object, prompt: str, n: int = 24) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # type: ignore[operator]
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=3
        )
    return [int(t) for t in out[0, ids.shape[1] :]]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_tied_dir"])
def test_hf_loads_and_greedy_output_varies(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = _hf_model(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for prompt in PROMPTS:
        new = _greedy(model, tokenizer, prompt)
        assert len(new) == 24
        assert len(set(new)) >= 12, f"{fixture} {prompt!r}: only {len(set(new))} distinct: {new}"


@pytest.mark.parametrize(
    "overrides",
    [
        {"family": "mistral"},
        {"attention_bias": True, "mlp_bias": True},  # Llama puts the bias on o_proj too
        {"head_dim": 64},
        {"vocab_size": 1000},
    ],
    ids=["mistral", "llama-biases", "head-dim", "vocab"],
)
def test_variants_load_with_every_weight(tmp_path: Path, overrides: dict[str, object]) -> None:
    path = init_checkpoint(tmp_path, "tiny", **overrides)  # type: ignore[arg-type]
    model = _hf_model(path)
    assert model.config.vocab_size == json.loads((path / "config.json").read_text())["vocab_size"]
    assert len(transformers.AutoTokenizer.from_pretrained(path)) == model.config.vocab_size


def test_files_and_config_per_family(tmp_path: Path) -> None:
    expected = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }
    for family, arch in expected.items():
        path = init_checkpoint(tmp_path / family, "tiny", family=family)
        names = {p.name for p in path.iterdir()}
        assert names == {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        }
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["architectures"] == [arch]
        assert cfg["torch_dtype"] == "float32"
        hf_cfg = transformers.AutoConfig.from_pretrained(path)
        assert type(hf_cfg).__name__ == arch.replace("ForCausalLM", "Config")
        gen = json.loads((path / "generation_config.json").read_text())
        assert (gen["bos_token_id"], gen["eos_token_id"]) == (
            cfg["bos_token_id"],
            cfg["eos_token_id"],
        )


def test_mistral_has_no_sliding_window(tmp_path: Path) -> None:
    # transformers would otherwise apply its 4096 default window to long prompts.
    path = init_checkpoint(tmp_path, "tiny", family="mistral")
    assert transformers.AutoConfig.from_pretrained(path).sliding_window is None


def test_qwen2_biases_are_present_and_change_the_output(tiny_qwen2_dir: Path) -> None:
    model = _hf_model(tiny_qwen2_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    biases = [
        m.bias for n, m in model.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj"))
    ]
    assert len(biases) == 3 * model.config.num_hidden_layers
    assert all(b is not None and b.abs().mean() > 0.1 for b in biases)
    with_bias = [_greedy(model, tokenizer, p) for p in PROMPTS[:2]]
    with torch.no_grad():
        for b in biases:
            b.zero_()
    without_bias = [_greedy(model, tokenizer, p) for p in PROMPTS[:2]]
    assert with_bias != without_bias


def test_tied_checkpoint_has_no_lm_head(tiny_tied_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_tied_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys
    model = _hf_model(tiny_tied_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_same_seed_gives_identical_files_and_other_seed_differs(tmp_path: Path) -> None:
    a = init_checkpoint(tmp_path / "a", "tiny", seed=7)
    b = init_checkpoint(tmp_path / "b", "tiny", seed=7)
    c = init_checkpoint(tmp_path / "c", "tiny", seed=8)
    for p in a.iterdir():
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_sharded_checkpoint_equals_single_file(tmp_path: Path, tiny_llama_dir: Path) -> None:
    sharded = init_checkpoint(tmp_path, "tiny", shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    ids = torch.tensor([[1, 50, 300, 7, 1000]])
    with torch.inference_mode():
        got = _hf_model(sharded)(ids).logits
        want = _hf_model(tiny_llama_dir)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    init_checkpoint(sharded, "tiny")  # rewriting as one file leaves no stale shard or index
    assert sorted(p.name for p in sharded.glob("model*")) == ["model.safetensors"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rope_parameters_style_is_the_same_model(tmp_path: Path, family: str) -> None:
    legacy = init_checkpoint(tmp_path / "legacy", "tiny", family=family)
    params = init_checkpoint(tmp_path / "params", "tiny", family=family, rope_style="parameters")
    cfg = json.loads((params / "config.json").read_text())
    assert "rope_theta" not in cfg
    assert cfg["rope_parameters"]["rope_type"] == "default"
    ids = torch.tensor([[1, *range(10, 400, 13)]])
    with torch.inference_mode():
        torch.testing.assert_close(_hf_model(params)(ids).logits, _hf_model(legacy)(ids).logits)


def _hf_param_count(cfg: dict[str, object]) -> int:
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights are one Parameter


def test_preset_shapes_and_parameter_counts() -> None:
    small = build_config("small")
    shape = {k: small[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    assert shape == {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8}
    assert (small["num_key_value_heads"], small["intermediate_size"]) == (4, 1408)
    assert (small["vocab_size"], small["torch_dtype"]) == (32000, "bfloat16")
    base = build_config("base")
    assert (base["vocab_size"], base["torch_dtype"]) == (32000, "bfloat16")
    assert build_config("tiny")["torch_dtype"] == "float32"
    for cfg in (small, base):
        assert cfg["max_position_embeddings"] >= 8192
    assert base["max_position_embeddings"] > 32768  # a 32K prompt and its first token
    variants = [
        small,
        base,
        build_config("tiny"),
        build_config("tiny", family="qwen2"),
        build_config("small", tie_word_embeddings=True),
    ]
    for cfg in variants:
        assert parameter_count(cfg) == _hf_param_count(cfg)
    assert 50e6 < parameter_count(small) < 60e6
    assert 300e6 < parameter_count(base) < 400e6


def test_cli_model_init(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    assert cli_main(["model", "init", str(out), "--preset", "tiny", "--seed", "3"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert cli_main(["model", "init", str(out), "--family", "qwen2"]) == 2  # not empty
    assert "--force" in capsys.readouterr().err
    assert cli_main(["model", "init", str(out), "--family", "qwen2", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
