"""The JSONL trace of captured traffic: what ``pdserve trace capture`` writes and
``pdserve bench serve --trace`` and ``pdserve sim plan`` replay.

One line per request: ``{"prompt_tokens": int, "output_tokens": int, "arrival_s": float}``,
optionally with the prompt's leading blocks by chained hash (``"block_size": int,
"block_hashes": [hex, ...]``) and its ``"tenant": str``; other keys are ignored. A malformed
line is refused with its place and the field named (``InvalidArgumentError``).

The benchmark turns a line's hashes into token blocks (``bench.serve.prefixes``); this module
only reads the file, so that every command replaying a trace reads it the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """What a trace line says of its prompt's content: its leading blocks, by hash."""

    block_hashes: tuple[bytes, ...] = ()
    """The chained hashes of the prompt's leading full blocks; empty: nothing known."""
    block_size: int | None = None
    """Tokens a block (set whenever ``block_hashes`` is not empty)."""
    tenant: str | None = None
    """The captured request's tenant (``""``: none); the hashes are salted with it, so two
    tenants' prompts never share a replayed block, as they never shared cached KV."""


NO_PREFIX = PromptPrefix()
"""A trace line that says nothing of its prompt's content."""


def read_prefix(obj: dict[str, Any], prompt_tokens: int, where: str) -> PromptPrefix:
    """The optional prefix fields of one trace line (``obj``, already checked to have a
    valid ``prompt_tokens``); ``InvalidArgumentError`` names the malformed field."""
    tenant = obj.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidArgumentError("trace", f"{where}: tenant must be a string")
    size = obj.get("block_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise InvalidArgumentError("trace", f"{where}: block_size must be an integer >= 1")
    raw = obj.get("block_hashes")
    if raw is None:
        return PromptPrefix(tenant=tenant, block_size=size)
    if not isinstance(raw, list):
        raise InvalidArgumentError("trace", f"{where}: block_hashes must be a list of hex strings")
    hashes = tuple(_hash(value, i, where) for i, value in enumerate(raw))
    if hashes and size is None:
        raise InvalidArgumentError("trace", f"{where}: block_size is needed with block_hashes")
    if size is not None and len(hashes) > max(0, prompt_tokens - 1) // size:
        raise InvalidArgumentError(
            "trace",
            f"{where}: block_hashes has {len(hashes)} blocks of {size} tokens, more than a "
            f"prompt of {prompt_tokens} tokens holds before its last token",
        )
    return PromptPrefix(hashes, size, tenant)


def _hash(value: object, i: int, where: str) -> bytes:
    if isinstance(value, str) and value and len(value) % 2 == 0:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    raise InvalidArgumentError(
        "trace", f"{where}: block_hashes[{i}] must be a non-empty hex string, got {value!r}"
    )


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One line of a JSONL trace."""

    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    prefix: PromptPrefix = NO_PREFIX
    """The captured prompt's leading blocks, by hash, and its tenant (empty: none given)."""


def load_trace(path: Path) -> tuple[TraceEntry, ...]:
    """Read a JSONL trace, sorted by arrival time (blank lines skipped). A line is
    ``{"prompt_tokens": int, "output_tokens": int, "arrival_s": float}``, optionally with
    ``"block_size": int, "block_hashes": [hex, ...]`` (at most ``(prompt_tokens - 1) //
    block_size`` of them) and ``"tenant": str``; other keys are ignored. A malformed line is
    refused with its place and the field named (``InvalidArgumentError``)."""
    entries = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError("trace", f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise InvalidArgumentError("trace", f"{where}: expected an object")
        for key in ("prompt_tokens", "output_tokens"):
            value = obj.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError("trace", f"{where}: {key} must be an integer >= 1")
        arrival = obj.get("arrival_s")
        if (
            not isinstance(arrival, int | float)
            or isinstance(arrival, bool)
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise InvalidArgumentError("trace", f"{where}: arrival_s must be a number >= 0")
        prompt_tokens = obj["prompt_tokens"]
        prefix = read_prefix(obj, prompt_tokens, where)
        entries.append(TraceEntry(prompt_tokens, obj["output_tokens"], float(arrival), prefix))
    if not entries:
        raise InvalidArgumentError("trace", f"{path}: no requests")
    return tuple(sorted(entries, key=lambda e: e.arrival_s))


def trace_rate(entries: tuple[TraceEntry, ...]) -> float | None:
    """The trace's own mean rate (requests/s), None when every request arrives at once."""
    span = entries[-1].arrival_s - entries[0].arrival_s
    return (len(entries) - 1) / span if span > 0 else None
