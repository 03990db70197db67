"""Model shapes from config.json and the built-in tables; accelerator and model look-up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.sim.shapes import (
    ACCELERATORS,
    MODELS,
    Accelerator,
    ModelShape,
    accelerator,
    model,
)

TINY = ModelShape("tiny", 2, 8, 2, 1, 4, 16, 10)

LLAMA3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / "config.json"
    file.write_text(json.dumps(config))
    return file


def test_tiny_parameter_counts_by_hand() -> None:
    # q 8*2*4 + k,v 2*8*1*4 + o 2*4*8 + gate/up/down 3*8*16 = 64 + 64 + 64 + 384
    assert TINY.layer_params == 576
    assert TINY.dense_params == 1152
    assert TINY.lm_head_params == 80
    assert TINY.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2 == 32
    # layers + embedding + head, bf16
    assert TINY.weight_bytes == (1152 + 80 + 80) * 2


def test_tied_embeddings_count_once() -> None:
    tied = ModelShape("tiny", 2, 8, 2, 1, 4, 16, 10, tie_word_embeddings=True)
    assert tied.weight_bytes == (1152 + 80) * 2
    fp32 = ModelShape("tiny", 2, 8, 2, 1, 4, 16, 10, dtype_bytes=4)
    assert fp32.weight_bytes == (1152 + 80 + 80) * 4
    assert fp32.kv_bytes_per_token == 64


def test_llama_3_8b_published_size() -> None:
    m = MODELS["llama-3-8b"]
    assert m.dense_params == pytest.approx(6.98e9, rel=0.01)
    assert m.kv_bytes_per_token == 131072
    # 8.03e9 parameters in all (the published "8B"), bf16
    assert m.weight_bytes == (6979321856 + 2 * 4096 * 128256) * 2


def test_builtin_70b_and_qwen_sizes() -> None:
    # The published totals: 70.6e9 and 7.6e9 parameters.
    assert MODELS["llama-3-70b"].weight_bytes / 2 == pytest.approx(70.55e9, rel=0.01)
    assert MODELS["qwen2-7b"].weight_bytes / 2 == pytest.approx(7.62e9, rel=0.01)


def test_json_round_trip() -> None:
    for m in [TINY, *MODELS.values()]:
        data = json.loads(json.dumps(m.to_json()))
        assert ModelShape.from_json(data) == m


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("num_layers"),
        lambda d: d.update(extra=1),
        lambda d: d.update(hidden_size=0),
        lambda d: d.update(head_dim="4"),
        lambda d: d.update(name=3),
        lambda d: d.update(tie_word_embeddings="no"),
    ],
)
def test_from_json_refuses_bad_dicts(mutate: Any) -> None:
    data = TINY.to_json()
    mutate(data)
    with pytest.raises(InvalidArgumentError) as e:
        ModelShape.from_json(data, flag="--x", source="f.json")
    assert e.value.field == "--x"
    assert "f.json" in str(e.value)


def test_from_config_matches_the_builtin(tmp_path: Path) -> None:
    write_config(tmp_path / "Meta-Llama-3-8B", LLAMA3_8B_CONFIG)
    shape = ModelShape.from_config(tmp_path / "Meta-Llama-3-8B")
    assert shape.name == "Meta-Llama-3-8B"
    builtin = MODELS["llama-3-8b"]
    assert shape.to_json() | {"name": builtin.name} == builtin.to_json()


def test_from_config_file_path_and_name(tmp_path: Path) -> None:
    file = write_config(tmp_path / "m", LLAMA3_8B_CONFIG)
    assert ModelShape.from_config(file, name="mine").name == "mine"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("torch_dtype", "float32", 4),
        ("torch_dtype", "float16", 2),
        ("dtype", "float32", 4),
        ("dtype", "bfloat16", 2),
        ("torch_dtype", "torch.float32", 4),
    ],
)
def test_dtype_from_torch_dtype_or_dtype(
    tmp_path: Path, key: str, value: str, expected: int
) -> None:
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "torch_dtype"}
    config[key] = value
    shape = ModelShape.from_config(write_config(tmp_path, config))
    assert shape.dtype_bytes == expected


def test_defaults_head_dim_kv_heads_dtype_tied(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 96,
        "num_attention_heads": 6,
        "intermediate_size": 256,
        "vocab_size": 1000,
    }
    shape = ModelShape.from_config(write_config(tmp_path, config))
    assert shape.head_dim == 16
    assert shape.num_kv_heads == 6
    assert shape.dtype_bytes == 2
    assert shape.tie_word_embeddings is False
    explicit = ModelShape.from_config(write_config(tmp_path / "b", config | {"head_dim": 32}))
    assert explicit.head_dim == 32


@pytest.mark.parametrize(
    "key",
    ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"],
)
def test_missing_field_refused_naming_key_and_flag(tmp_path: Path, key: str) -> None:
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != key}
    file = write_config(tmp_path, config)
    with pytest.raises(InvalidArgumentError) as e:
        ModelShape.from_config(file, flag="--model-shape")
    assert e.value.field == "--model-shape"
    assert key in str(e.value)
    assert str(file) in str(e.value)


@pytest.mark.parametrize(
    "change",
    [
        {"hidden_size": 0},
        {"num_hidden_layers": -1},
        {"vocab_size": 1.5},
        {"num_key_value_heads": 5},  # 32 heads are not a multiple of 5
        {"torch_dtype": "int4"},
        {"tie_word_embeddings": "yes"},
    ],
)
def test_invalid_values_refused(tmp_path: Path, change: dict[str, Any]) -> None:
    file = write_config(tmp_path, LLAMA3_8B_CONFIG | change)
    with pytest.raises(InvalidArgumentError) as e:
        ModelShape.from_config(file)
    assert e.value.field == "--sim-profile"
    assert next(iter(change)) in str(e.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_unreadable_config_refused(tmp_path: Path, text: str) -> None:
    file = tmp_path / "config.json"
    file.write_text(text)
    with pytest.raises(InvalidArgumentError) as e:
        ModelShape.from_config(file)
    assert str(file) in str(e.value)


def test_missing_config_file_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        ModelShape.from_config(tmp_path / "nope.json")
    assert "nope.json" in str(e.value)


def test_model_lookup(tmp_path: Path) -> None:
    assert model("qwen2-7b") is MODELS["qwen2-7b"]
    write_config(tmp_path, LLAMA3_8B_CONFIG)
    assert model(str(tmp_path)).num_layers == 32
    assert model(tmp_path / "config.json").num_kv_heads == 8
    with pytest.raises(InvalidArgumentError) as e:
        model("gpt-17", flag="--m")
    assert e.value.field == "--m"
    assert "gpt-17" in str(e.value)
    for name in MODELS:
        assert name in str(e.value)


def test_accelerator_lookup_and_aliases() -> None:
    assert accelerator("h100") is ACCELERATORS["h100-sxm"]
    assert accelerator("A100") is ACCELERATORS["a100-80gb"]
    h100 = accelerator("h100-sxm")
    assert (h100.peak_flops, h100.mem_bandwidth, h100.interconnect_bandwidth) == (
        989e12,
        3.35e12,
        450e9,
    )
    assert h100.mem_bytes == 80 * 2**30
    assert (h100.compute_efficiency, h100.memory_efficiency, h100.step_overhead_s) == (
        0.6,
        0.8,
        0.001,
    )
    a100 = accelerator("a100-80gb")
    assert (a100.peak_flops, a100.mem_bandwidth, a100.interconnect_bandwidth) == (
        312e12,
        2.039e12,
        300e9,
    )


def test_unknown_accelerator_refused_listing_names() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        accelerator("tpu-v5", flag="--acc")
    assert e.value.field == "--acc"
    for name in ("h100", "h100-sxm", "a100", "a100-80gb"):
        assert name in str(e.value)


def test_accelerator_is_frozen() -> None:
    acc = Accelerator("x", 1.0, 1.0, 1, 1.0)
    with pytest.raises(AttributeError):
        acc.peak_flops = 2.0  # type: ignore[misc]
