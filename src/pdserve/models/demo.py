"""Locally-made demo checkpoints: deterministic random weights in the Hugging Face layout.

``init_checkpoint(dir, "tiny")`` writes a directory that ``transformers`` loads offline with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` and that pdserve
serves: ``config.json``, ``model.safetensors`` (or shards plus an index), ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``.

Presets (parameter counts are for the untied Llama family, the default):

======  ======  ======  =====  ========  ============  =====  ============  ========
preset  hidden  layers  heads  kv heads  intermediate  vocab  params        dtype
======  ======  ======  =====  ========  ============  =====  ============  ========
tiny    128     4       4      2         352           2048   1,262,720     float32
small   512     8       8      4         1408          32000  56,369,664    bfloat16
base    1024    24      16     8         2816          32000  348,701,696   bfloat16
======  ======  ======  =====  ========  ============  =====  ============  ========

Positions (``max_position_embeddings``): 8192 for tiny and small, 40960 for base (32K-token
prompts; the positions do not change any weight, only how long a prompt may be).

NOTE: the usual init (std 0.02) gives a model that answers every greedy step with the same token,
so a parity test against it proves nothing. Here every matrix has std ``1.7 / sqrt(fan_in)``
(0.15 for the tiny preset), norms are ``1 + N(0, 0.1)`` and Qwen2 q/k/v biases are ``N(0, 0.5)``:
greedy output varies from step to step, and a wrong rotary, bias or norm changes the tokens.

The tokenizer is a byte-level BPE trained here, in a few seconds, on generated text (see
``pdserve.models.corpus``), with ``<unk>``=0, ``<s>``=1, ``</s>``=2, ``<pad>``=3. Llama and Mistral
prompts start with ``<s>``; the qwen2 family uses the Qwen2 pre-tokenizer and adds no BOS, as the
real Qwen2 does (transformers rebuilds Qwen2 tokenizers that way whatever tokenizer.json says).

Each tensor is drawn from its own generator seeded by ``(seed, name)``, so a tensor's values do
not depend on which other tensors exist: the sharded and tied variants of a seed agree on every
tensor they share.
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.errors import InvalidArgumentError
from pdserve.models.corpus import (
    BOS_ID,
    BOS_TOKEN,
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    UNK_TOKEN,
    train_tokenizer_json,
)

INIT_GAIN = 1.7  # matrix std = INIT_GAIN / sqrt(fan_in); 0.15 at fan_in 128
NORM_NOISE_STD = 0.1
BIAS_STD = 0.5


@dataclass(frozen=True, slots=True)
class Preset:
    """The shape of one demo model size."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: str
    max_position_embeddings: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(128, 4, 4, 2, 352, 2048, "float32", 8192),
    "small": Preset(512, 8, 8, 4, 1408, 32000, "bfloat16", 8192),
    # 40960 positions (32K + 8K, as some released models have): a 32768-token prompt fits with
    # room for its output, for the transfer benchmark's 32K payloads.
    "base": Preset(1024, 24, 16, 8, 2816, 32000, "bfloat16", 40960),
}

# Per-family config defaults. Rope theta and eps differ on purpose, as in the real models, so
# an engine that hard-codes one family's values fails parity on another.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        # transformers defaults a missing sliding_window to 4096; say "none" explicitly.
        "sliding_window": None,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": None,
    },
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

ROPE_STYLES = ("legacy", "parameters")


def build_config(
    preset: str = "tiny", *, family: str = "llama", dtype: str | None = None, **overrides: Any
) -> dict[str, Any]:
    """The ``config.json`` content for a preset, family and config-key overrides.

    ``rope_style="parameters"`` writes the transformers-5 ``rope_parameters`` dict (holding
    ``rope_theta`` and any ``rope_scaling`` keys) instead of ``rope_theta``/``rope_scaling``.
    """
    if preset not in PRESETS:
        raise InvalidArgumentError("preset", f"unknown preset {preset!r}; one of {sorted(PRESETS)}")
    if family not in FAMILIES:
        raise InvalidArgumentError(
            "family", f"unknown family {family!r}; one of {sorted(FAMILIES)}"
        )
    p = PRESETS[preset]
    dtype = dtype or p.dtype
    if dtype not in DTYPES:
        raise InvalidArgumentError("dtype", f"unknown dtype {dtype!r}; one of {sorted(DTYPES)}")
    rope_style = overrides.pop("rope_style", "legacy")
    if rope_style not in ROPE_STYLES:
        raise InvalidArgumentError("rope_style", f"must be one of {ROPE_STYLES}")
    overrides.pop("shards", None)

    cfg: dict[str, Any] = dict(FAMILIES[family])
    cfg.update(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=False,
        initializer_range=INIT_GAIN / math.sqrt(p.hidden_size),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype=dtype,
        use_cache=True,
    )
    cfg.update(overrides)
    cfg.setdefault("head_dim", int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    if rope_style == "parameters":
        scaling = cfg.pop("rope_scaling", None) or {"rope_type": "default"}
        cfg["rope_parameters"] = {**scaling, "rope_theta": cfg.pop("rope_theta")}
    return dict(sorted(cfg.items()))


def parameter_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for a config, in file order; no tensor is made."""
    hidden = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    qwen2 = "Qwen2ForCausalLM" in cfg.get("architectures", ())
    qkv_bias = qwen2 or bool(cfg.get("attention_bias", False))
    o_bias = not qwen2 and bool(cfg.get("attention_bias", False))  # Llama puts it on o_proj too
    mlp_bias = bool(cfg.get("mlp_bias", False))

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(int(cfg["num_hidden_layers"])):
        pre = f"model.layers.{i}"
        attn_out = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
        for name, out in attn_out.items():
            shapes[f"{pre}.self_attn.{name}_proj.weight"] = (out, hidden)
            if qkv_bias:
                shapes[f"{pre}.self_attn.{name}_proj.bias"] = (out,)
        shapes[f"{pre}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if o_bias:
            shapes[f"{pre}.self_attn.o_proj.bias"] = (hidden,)
        for name, shape in (
            ("gate", (inter, hidden)),
            ("up", (inter, hidden)),
            ("down", (hidden, inter)),
        ):
            shapes[f"{pre}.mlp.{name}_proj.weight"] = shape
            if mlp_bias:
                shapes[f"{pre}.mlp.{name}_proj.bias"] = (shape[0],)
        shapes[f"{pre}.input_layernorm.weight"] = (hidden,)
        shapes[f"{pre}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    return shapes


def parameter_count(cfg: Mapping[str, Any]) -> int:
    """Number of parameters a config describes (tied embeddings counted once)."""
    return sum(math.prod(shape) for shape in parameter_shapes(cfg).values())


def _init_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + NORM_NOISE_STD * noise
    if name.endswith(".bias"):
        return BIAS_STD * noise
    # Weights are [out_features, in_features]; embeddings are [vocab, hidden] and feed a norm, so
    # both use the last dim as fan-in (that also makes a tied lm_head well scaled).
    return noise * (INIT_GAIN / math.sqrt(shape[-1]))


def init_weights(cfg: Mapping[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights for ``cfg`` in its ``torch_dtype``."""
    dtype = DTYPES[str(cfg.get("torch_dtype", "float32"))]
    return {
        name: _init_tensor(name, shape, seed).to(dtype)
        for name, shape in parameter_shapes(cfg).items()
    }


def _write_weights(path: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    old_layout = [path / "model.safetensors", path / "model.safetensors.index.json"]
    for stale in [*old_layout, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)  # a previous layout would shadow or confuse this one
    meta = {"format": "pt"}
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata=meta)
        return
    total = sum(t.numel() * t.element_size() for t in weights.values())
    names = list(weights)
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for name in names:  # contiguous runs of about total/shards bytes each
        t = weights[name]
        groups[min(acc * shards // total, shards - 1)].append(name)
        acc += t.numel() * t.element_size()
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in group}, str(path / file), metadata=meta)
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(path / "model.safetensors.index.json", index)


def _write_json(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# A minimal chat format, so chat-style clients have something to render with.
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _write_tokenizer(path: Path, cfg: Mapping[str, Any]) -> None:
    # Qwen2 prompts carry no BOS, and transformers rebuilds Qwen2 tokenizers with the Qwen2
    # split regex whatever tokenizer.json says: the qwen2 demo matches both, like the real one.
    qwen2 = cfg["model_type"] == "qwen2"
    tokenizer_json = train_tokenizer_json(int(cfg["vocab_size"]), "qwen2" if qwen2 else "bytelevel")
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "Qwen2Tokenizer" if qwen2 else "PreTrainedTokenizerFast",
        "bos_token": None if qwen2 else BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": not qwen2,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(cfg["max_position_embeddings"]),
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(path / "tokenizer_config.json", tok_cfg)
    gen_cfg = {
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"),
    }
    _write_json(path / "generation_config.json", gen_cfg)


def init_checkpoint(
    path: str | Path,
    preset: str = "tiny",
    *,
    family: str = "llama",
    seed: int = 0,
    dtype: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a deterministic random-init checkpoint to ``path`` (created if needed).

    ``overrides`` are config.json keys (``tie_word_embeddings=True``, ``rope_scaling={...}``,
    ``vocab_size=...``), plus two layout keys: ``shards=N`` splits the weights into N files with
    a ``model.safetensors.index.json``; ``rope_style="parameters"`` writes ``rope_parameters``.
    Files this function writes are overwritten; other files in ``path`` are left alone.
    """
    shards = overrides.get("shards", 1)
    if not isinstance(shards, int) or shards < 1:
        raise InvalidArgumentError("shards", "must be a positive integer")
    cfg = build_config(preset, family=family, dtype=dtype, **overrides)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _write_weights(out, init_weights(cfg, seed), shards)
    _write_tokenizer(out, cfg)
    return out


def model_parser() -> argparse.ArgumentParser:
    """The parser of ``pdserve model ...`` (for now one subcommand, ``init``)."""
    parser = argparse.ArgumentParser(prog="pdserve model", description="make demo checkpoints")
    sub = parser.add_subparsers(dest="model_command", required=True)
    init = sub.add_parser("init", help="write a deterministic random-init demo checkpoint")
    init.add_argument("dir", type=Path, help="directory to write the checkpoint into")
    init.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    init.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the preset's")
    init.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    init.add_argument("--force", action="store_true", help="write into a non-empty directory")
    return parser


def run_model_init(args: argparse.Namespace) -> int:
    """Carry out a parsed ``model init`` command; returns the exit status."""
    path: Path = args.dir
    if path.exists() and any(path.iterdir()) and not args.force:
        raise InvalidArgumentError("dir", f"{path} is not empty; pass --force to overwrite")
    init_checkpoint(
        path, args.preset, family=args.family, seed=args.seed, dtype=args.dtype, shards=args.shards
    )
    cfg = json.loads((path / "config.json").read_text())
    print(
        f"wrote {args.preset} {args.family} checkpoint ({parameter_count(cfg):,} params) to {path}"
    )
    return 0


def main_model(argv: Sequence[str]) -> int:
    """Entry of ``pdserve model``: ``argv`` is what follows ``model`` on the command line."""
    args = model_parser().parse_args(list(argv))
    return run_model_init(args)  # "init" is the only subcommand so far


def main_model_init(argv: Sequence[str]) -> int:
    """``pdserve model init`` with ``argv`` being what follows ``init``."""
    return main_model(["init", *argv])
