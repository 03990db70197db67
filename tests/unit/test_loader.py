"""Weight loading, missing-file errors, fingerprints, and ModelConfig against transformers."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.errors import ModelLoadError
from pdserve.models.config import ModelConfig
from pdserve.models.demo import init_checkpoint
from pdserve.models.loader import checkpoint_fingerprint, load_state_dict
from pdserve.tokenizer import Tokenizer


@pytest.fixture()
def llama_copy(tmp_path: Path, tiny_llama_dir: Path) -> Path:
    """A private copy of the tiny checkpoint, free to damage."""
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "ckpt"))


@pytest.fixture()
def sharded(tmp_path: Path) -> Path:
    return init_checkpoint(tmp_path / "sharded", "tiny", shards=3)


def test_load_single_file_matches_safetensors(tiny_llama_dir: Path) -> None:
    state = load_state_dict(tiny_llama_dir)
    want = load_file(str(tiny_llama_dir / "model.safetensors"))
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name


def test_load_sharded_equals_single_and_casts(sharded: Path, tiny_llama_dir: Path) -> None:
    single = load_state_dict(tiny_llama_dir)
    state = load_state_dict(sharded, dtype=torch.bfloat16)
    assert state.keys() == single.keys()
    for name, tensor in single.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


def test_state_dict_names_are_what_transformers_expects(tiny_qwen2_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(tiny_qwen2_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert set(load_state_dict(tiny_qwen2_dir)) == set(model.state_dict())


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(llama_copy: Path, name: str) -> None:
    (llama_copy / name).unlink()
    loader = {
        "config.json": ModelConfig.from_dir,
        "tokenizer.json": Tokenizer.from_dir,
        "model.safetensors": load_state_dict,
    }[name]
    with pytest.raises(ModelLoadError, match=re.escape(name)):
        loader(llama_copy)


def test_missing_shard_is_named(sharded: Path) -> None:
    (sharded / "model-00002-of-00003.safetensors").unlink()
    for call in (load_state_dict, checkpoint_fingerprint):
        with pytest.raises(ModelLoadError, match=r"model-00002-of-00003\.safetensors"):
            call(sharded)


def test_index_naming_an_absent_tensor_is_refused(sharded: Path) -> None:
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00003.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load_state_dict(sharded)


def test_corrupt_weights_are_named(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_state_dict(llama_copy)


def test_fingerprint_is_stable_and_tells_models_apart(tmp_path: Path, tiny_llama_dir: Path) -> None:
    fp = checkpoint_fingerprint(tiny_llama_dir)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert checkpoint_fingerprint(shutil.copytree(tiny_llama_dir, tmp_path / "copy")) == fp
    assert checkpoint_fingerprint(init_checkpoint(tmp_path / "same", "tiny")) == fp
    others = [
        init_checkpoint(tmp_path / "seed1", "tiny", seed=1),
        init_checkpoint(tmp_path / "bf16", "tiny", dtype="bfloat16"),
        init_checkpoint(tmp_path / "wider", "tiny", intermediate_size=384),
        init_checkpoint(tmp_path / "sharded", "tiny", shards=2),
    ]
    fps = {checkpoint_fingerprint(p) for p in others}
    assert len(fps) == len(others) and fp not in fps


def test_fingerprint_sees_a_changed_tensor(llama_copy: Path) -> None:
    before = checkpoint_fingerprint(llama_copy)
    state = load_file(str(llama_copy / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0  # the last tensor in the file
    from safetensors.torch import save_file

    save_file(state, str(llama_copy / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_fingerprint(llama_copy) != before


# -- ModelConfig read the way transformers reads it --------------------------------------------

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
VARIANTS = {
    "llama": {},
    "llama-rope-parameters": {"rope_style": "parameters"},
    "llama-theta": {"rope_theta": 500000.0},
    "llama-theta-rope-parameters": {"rope_theta": 500000.0, "rope_style": "parameters"},
    "llama3-scaling": {"rope_theta": 500000.0, "rope_scaling": LLAMA3},
    "llama3-scaling-rope-parameters": {
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3,
        "rope_style": "parameters",
    },
    "qwen2": {"family": "qwen2"},
    "qwen2-rope-parameters": {"family": "qwen2", "rope_style": "parameters"},
    "mistral": {"family": "mistral"},
    "tied": {"tie_word_embeddings": True},
    "head-dim": {"head_dim": 64, "num_attention_heads": 4},
    "eos-list": {"eos_token_id": [2, 5]},
}


def _reference_inv_freq(theta: float, dim: int, scaling: dict[str, float] | None) -> torch.Tensor:
    """Rotary inverse frequencies, with Meta's published Llama 3 scaling rule."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if scaling is None:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(f)
        elif wavelen > old_ctx / low:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_config_reads_like_transformers(tmp_path: Path, variant: str) -> None:
    transformers = pytest.importorskip("transformers")
    overrides = dict(VARIANTS[variant])
    family = str(overrides.pop("family", "llama"))
    path = init_checkpoint(tmp_path, "tiny", family=family, num_hidden_layers=1, **overrides)
    ours = ModelConfig.from_dir(path)
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)

    assert ours.family == family
    assert ours.vocab_size == hf_cfg.vocab_size
    assert ours.hidden_size == hf_cfg.hidden_size
    assert ours.intermediate_size == hf_cfg.intermediate_size
    assert ours.num_layers == hf_cfg.num_hidden_layers
    assert ours.num_heads == hf_cfg.num_attention_heads
    assert ours.num_kv_heads == hf_cfg.num_key_value_heads
    attn = hf.model.layers[0].self_attn
    assert ours.head_dim == attn.head_dim
    assert ours.rms_norm_eps == hf.model.norm.variance_epsilon
    assert ours.max_position_embeddings == hf_cfg.max_position_embeddings
    assert ours.tie_word_embeddings == (hf.lm_head.weight is hf.model.embed_tokens.weight)
    assert ours.attention_bias == (attn.q_proj.bias is not None)
    assert ours.bos_token_id == hf_cfg.bos_token_id
    hf_eos = hf_cfg.eos_token_id
    assert list(ours.eos_token_ids) == (hf_eos if isinstance(hf_eos, list) else [hf_eos])

    # Rotary: what transformers computes vs the reference rule fed with ModelConfig's fields.
    scaling = ours.rope_scaling
    ours_scaling = None
    if scaling is not None:
        ours_scaling = {
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    assert (ours_scaling is not None) == ("llama3" in variant)
    want = _reference_inv_freq(ours.rope_theta, ours.head_dim, ours_scaling)
    hf_inv = hf.model.rotary_emb.inv_freq.to(torch.float64)
    torch.testing.assert_close(hf_inv, want, rtol=1e-6, atol=0)
