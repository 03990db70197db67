"""Reading a checkpoint directory's weights, and a cheap fingerprint of the model.

Layouts understood (the Hugging Face ones): a single ``model.safetensors``, or shards named by
``model.safetensors.index.json``. As in ``transformers``, a single file wins over an index when
both exist. Every missing or unreadable file raises ``ModelLoadError`` naming the file, before
any weights are read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pdserve.errors import ModelLoadError

CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Bytes hashed from each end of a weight file: the safetensors header (names, shapes, offsets)
# sits at the start, and 64 KiB from each end reaches well into the tensor data.
_FINGERPRINT_EDGE_BYTES = 64 * 1024


def _require(file: Path) -> Path:
    if not file.is_file():
        raise ModelLoadError(f"missing file: {file}")
    return file


def _read_index(file: Path) -> dict[str, str]:
    try:
        index = json.loads(file.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot parse {file}: {e!r}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{file} has an empty or malformed weight_map")
    return {str(k): str(v) for k, v in weight_map.items()}


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files holding the weights, checked to exist, in a stable order."""
    root = Path(path)
    single = root / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index = root / INDEX_NAME
    if not index.is_file():
        raise ModelLoadError(f"missing file: {single} (and no {INDEX_NAME} in {root})")
    shard_names = sorted(set(_read_index(index).values()))
    return [_require(root / name) for name in shard_names]


def load_state_dict(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint by HF name; floating tensors cast to ``dtype`` if given."""
    root = Path(path)
    files = weight_files(root)
    index = root / INDEX_NAME
    expected = _read_index(index) if files[0].name != WEIGHTS_NAME else None
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file), device="cpu")
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e
        for name, tensor in tensors.items():
            if name in state:
                raise ModelLoadError(f"tensor {name!r} appears twice (again in {file})")
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            state[name] = tensor
    if expected is not None:
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ModelLoadError(
                f"{index} names {len(missing)} tensors its shards lack, e.g. "
                f"{missing[0]!r} in {expected[missing[0]]}"
            )
    return state


def _hash_edges(h: hashlib._Hash, file: Path) -> None:
    size = file.stat().st_size
    h.update(f"{file.name}:{size}\n".encode())
    with file.open("rb") as f:
        h.update(f.read(_FINGERPRINT_EDGE_BYTES))
        if size > _FINGERPRINT_EDGE_BYTES:
            f.seek(max(_FINGERPRINT_EDGE_BYTES, size - _FINGERPRINT_EDGE_BYTES))
            h.update(f.read())


def checkpoint_fingerprint(path: str | Path) -> str:
    """A short stable id of the model: 16 hex digits.

    Hashes ``config.json``, the weight index if any, and each weight file's name, size and first
    and last 64 KiB (plus ``tokenizer.json`` the same way when present). It reads at most a few
    hundred KiB whatever the checkpoint size, and any re-initialisation changes the tensor bytes
    at both ends of every file.
    """
    root = Path(path)
    h = hashlib.sha256()
    h.update(_require(root / CONFIG_NAME).read_bytes())
    files = weight_files(root)
    if files[0].name != WEIGHTS_NAME:
        h.update((root / INDEX_NAME).read_bytes())
    for file in files:
        _hash_edges(h, file)
    tokenizer = root / TOKENIZER_NAME
    if tokenizer.is_file():
        _hash_edges(h, tokenizer)
    return h.hexdigest()[:16]
