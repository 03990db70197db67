"""What the simulator models: a model's shape and an accelerator's datasheet.

The timing models (``pdserve.sim.timing``) need only a handful of numbers: parameter counts
(FLOPs per token and bytes of weights read per step), the KV bytes each token adds, and the
accelerator's peak rates. ``ModelShape`` holds the first, read from a Hugging Face
``config.json`` or taken from ``MODELS``; ``Accelerator`` holds the second (``ACCELERATORS``).
No weights are loaded and no tensor library is imported: a simulated worker of a 70B model
runs on a laptop.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pdserve.errors import InvalidArgumentError

_DEFAULT_FLAG = "--sim-profile"

# Bytes per element of the dtype names a config.json may carry (``torch_dtype``, or ``dtype``
# in newer transformers releases); "torch." prefixes are stripped first.
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}

_INT_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "dtype_bytes",
)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a dense decoder-only transformer (Llama/Qwen2 family: grouped-query
    attention, gated MLP). Norm weights and biases are ignored: they are < 0.1% of the
    parameters and of the FLOPs."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer: 2 * layers * kv_heads * head_dim * dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def layer_params(self) -> int:
        """Matmul parameters of one layer: q [hidden, heads*hd], k and v [hidden, kv*hd],
        o [heads*hd, hidden], MLP gate/up [hidden, inter] and down [inter, hidden]."""
        h, hd = self.hidden_size, self.head_dim
        q = h * self.num_heads * hd
        kv = 2 * h * self.num_kv_heads * hd
        o = self.num_heads * hd * h
        mlp = 3 * h * self.intermediate_size
        return q + kv + o + mlp

    @property
    def dense_params(self) -> int:
        """Parameters every token multiplies through (all layers, no embedding or LM head)."""
        return self.num_layers * self.layer_params

    @property
    def lm_head_params(self) -> int:
        """The [hidden, vocab] projection to logits; runs only for rows that sample."""
        return self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight: layers, embedding, and the LM head unless it is the
        embedding (tied). This is what a step streams from memory at least once."""
        embedding = self.hidden_size * self.vocab_size
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return (self.dense_params + embedding + head) * self.dtype_bytes

    def to_json(self) -> dict[str, Any]:
        """A plain dict of the fields (for fitted-profile files)."""
        return asdict(self)

    @classmethod
    def from_json(
        cls, data: Any, *, flag: str = _DEFAULT_FLAG, source: str = "model shape"
    ) -> ModelShape:
        """The inverse of ``to_json``; a missing, extra or ill-typed field is refused with an
        ``InvalidArgumentError`` naming ``flag`` and ``source`` (where the dict came from)."""
        if not isinstance(data, dict):
            raise InvalidArgumentError(flag, f"{source}: the model shape is not an object")
        names = {f.name for f in fields(cls)}
        missing = sorted(names - {"dtype_bytes", "tie_word_embeddings"} - data.keys())
        extra = sorted(data.keys() - names)
        if missing or extra:
            raise InvalidArgumentError(
                flag, f"{source}: model shape missing {missing or 'nothing'}, unknown {extra}"
            )
        name = data["name"]
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(flag, f"{source}: model shape 'name' must be a string")
        tied = data.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise InvalidArgumentError(flag, f"{source}: 'tie_word_embeddings' must be a bool")
        ints = {k: _positive_int(data, k, flag, source) for k in _INT_FIELDS if k in data}
        return cls(name=name, tie_word_embeddings=tied, **ints)

    @classmethod
    def from_config(
        cls, path: Path | str, name: str | None = None, *, flag: str = _DEFAULT_FLAG
    ) -> ModelShape:
        """Read a Hugging Face ``config.json`` (``path`` is the file or its directory).

        Needed keys: ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
        ``intermediate_size``, ``vocab_size``. Optional: ``num_key_value_heads`` (default: the
        attention heads, i.e. no grouping), ``head_dim`` (default hidden / heads),
        ``tie_word_embeddings`` (default False), ``torch_dtype`` or ``dtype`` (default
        bfloat16). ``name`` defaults to the directory holding the file.
        """
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise InvalidArgumentError(flag, f"cannot read model config {file}: {e}") from e
        if not isinstance(raw, dict):
            raise InvalidArgumentError(flag, f"{file}: a model config must be a JSON object")
        src = str(file)
        heads = _positive_int(raw, "num_attention_heads", flag, src)
        hidden = _positive_int(raw, "hidden_size", flag, src)
        kv_heads = heads
        if raw.get("num_key_value_heads") is not None:
            kv_heads = _positive_int(raw, "num_key_value_heads", flag, src)
        if heads % kv_heads:
            raise InvalidArgumentError(
                flag,
                f"{file}: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}",
            )
        if raw.get("head_dim") is not None:
            head_dim = _positive_int(raw, "head_dim", flag, src)
        elif hidden % heads:
            raise InvalidArgumentError(
                flag,
                f"{file}: no head_dim, and hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads}",
            )
        else:
            head_dim = hidden // heads
        tied = raw.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise InvalidArgumentError(flag, f"{file}: 'tie_word_embeddings' must be a bool")
        return cls(
            name=name or file.resolve().parent.name or file.stem,
            num_layers=_positive_int(raw, "num_hidden_layers", flag, src),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_positive_int(raw, "intermediate_size", flag, src),
            vocab_size=_positive_int(raw, "vocab_size", flag, src),
            dtype_bytes=_config_dtype_bytes(raw, flag, src),
            tie_word_embeddings=tied,
        )


def _positive_int(data: dict[str, Any], key: str, flag: str, source: str) -> int:
    """``data[key]`` as a positive int, or an ``InvalidArgumentError`` naming key and source."""
    if key not in data or data[key] is None:
        raise InvalidArgumentError(flag, f"{source}: missing '{key}'")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(flag, f"{source}: '{key}' must be a positive int, not {value!r}")
    return value


def _config_dtype_bytes(raw: dict[str, Any], flag: str, source: str) -> int:
    key = "torch_dtype" if raw.get("torch_dtype") is not None else "dtype"
    value = raw.get(key)
    if value is None:
        return 2  # Checkpoints that name no dtype are served in bf16 by default.
    name = str(value).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise InvalidArgumentError(
            flag, f"{source}: '{key}' {value!r} is not one of {sorted(_DTYPE_BYTES)}"
        )
    return _DTYPE_BYTES[name]


# Published shapes (each model's config.json on the Hugging Face hub), all bf16.
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelShape("qwen2-7b", 28, 3584, 28, 4, 128, 18944, 152064),
    )
}


def model(name_or_path: str | Path, flag: str = _DEFAULT_FLAG) -> ModelShape:
    """A built-in shape by name (``MODELS``), else a ``config.json`` file or its directory."""
    key = str(name_or_path)
    if key in MODELS:
        return MODELS[key]
    path = Path(key)
    if key and path.exists():
        return ModelShape.from_config(path, flag=flag)
    raise InvalidArgumentError(
        flag,
        f"unknown model {key!r}: not one of {sorted(MODELS)} and no config.json at that path",
    )


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One accelerator's datasheet rates and the fractions of them a serving step achieves.

    ``peak_flops`` is dense (no sparsity) bf16 FLOP/s; ``mem_bandwidth`` and
    ``interconnect_bandwidth`` are bytes/s, the latter per direction of the link that
    tensor-parallel all-reduces use.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: int
    interconnect_bandwidth: float
    # Large prefills are GEMM-bound and reach roughly 50-70% model FLOPs utilisation on
    # tuned serving stacks (attention, norms and epilogues cost the rest): 0.6.
    compute_efficiency: float = 0.6
    # Streaming reads (decode weight and KV reads) sustain about 80-90% of the HBM datasheet
    # bandwidth in practice (STREAM-like kernels); 0.8 leaves room for imperfect overlap.
    memory_efficiency: float = 0.8
    # Per-step fixed cost: kernel launches, scheduling, sampling and host bookkeeping, about
    # a millisecond per step on serving engines with CUDA graphs.
    step_overhead_s: float = 0.001


_GIB = 1 << 30

ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16 (1979 is with 2:4 sparsity),
    # 3.35 TB/s HBM3, 80 GB; NVLink 4 is 900 GB/s bidirectional, 450 GB/s each way.
    "h100-sxm": Accelerator("h100-sxm", 989e12, 3.35e12, 80 * _GIB, 450e9),
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOPS dense BF16, 2,039 GB/s HBM2e, 80 GB;
    # NVLink 3 is 600 GB/s bidirectional, 300 GB/s each way.
    "a100-80gb": Accelerator("a100-80gb", 312e12, 2.039e12, 80 * _GIB, 300e9),
}

ACCELERATOR_ALIASES: dict[str, str] = {"h100": "h100-sxm", "a100": "a100-80gb"}


def accelerator(name: str, flag: str = _DEFAULT_FLAG) -> Accelerator:
    """An accelerator by name or alias (case-insensitive); unknown names are refused."""
    key = name.strip().lower()
    key = ACCELERATOR_ALIASES.get(key, key)
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    known = sorted([*ACCELERATORS, *ACCELERATOR_ALIASES])
    raise InvalidArgumentError(flag, f"unknown accelerator {name!r}; known: {', '.join(known)}")
