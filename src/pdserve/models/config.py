"""The model shape, read from a Hugging Face style ``config.json``.

One reader for Llama 2/3 (including ``rope_scaling`` of type ``llama3``), Mistral and Qwen2.
Both the older ``rope_theta`` key and the newer ``rope_parameters`` dict are understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ModelLoadError

# architecture name in config.json -> our family name
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 frequency-dependent rope scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model file needs to know about a checkpoint's shape."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    """q/k/v projections have a bias (Qwen2 always; Llama when ``attention_bias``)."""
    o_proj_bias: bool
    """The output projection has a bias too (Llama's ``attention_bias``; not Qwen2)."""
    sliding_window: int | None
    """Mistral/Qwen2 sliding-window attention span; the engine caps its length at it."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope_params = cfg.get("rope_parameters") or {}
            theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
            scaling_cfg = cfg.get("rope_scaling") or (
                rope_params if rope_params.get("rope_type", "default") != "default" else None
            )
            scaling = _parse_rope_scaling(scaling_cfg)
            if cfg.get("mlp_bias"):
                raise ModelLoadError("config.json sets mlp_bias, which is not supported")
            window = cfg.get("sliding_window")
            if family == "qwen2" and not cfg.get("use_sliding_window", False):
                window = None
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias; Llama may declare attention_bias.
                attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_proj_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing the key {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelLoadError(f"missing file: {file}")
        return cls.from_dict(json.loads(file.read_text()))


def _parse_rope_scaling(cfg: dict[str, Any] | None) -> RopeScaling | None:
    if not cfg:
        return None
    kind = cfg.get("rope_type", cfg.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"unsupported rope_scaling type {kind!r}; supported: ['llama3']")
    return RopeScaling(
        factor=float(cfg["factor"]),
        low_freq_factor=float(cfg["low_freq_factor"]),
        high_freq_factor=float(cfg["high_freq_factor"]),
        original_max_position_embeddings=int(cfg["original_max_position_embeddings"]),
    )
