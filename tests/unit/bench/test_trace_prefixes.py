"""Replaying a captured trace keeps its prefix sharing: prompts whose captured block hashes
agree on their first ``k`` blocks share exactly ``k * block_size`` leading tokens, the rest is
each request's own, the same seed gives the same prompts, old three-key traces replay as
before, and malformed prefix fields are refused by name."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.block_manager import chain_block_hashes
from pdserve.errors import InvalidArgumentError
from pdserve.trace_file import PromptPrefix, TraceEntry, load_trace
from pdserve_bench.measure import FIRST_PROMPT_ID, make_prompts
from pdserve_bench.serve.prefixes import BlockTokens
from pdserve_bench.serve.workload import Load

VOCAB = 32000
BLOCK = 4


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _line(prompt: Sequence[int], arrival: float, tenant: str = "t") -> dict[str, Any]:
    """A trace line as ``pdserve trace capture`` writes it for ``prompt``."""
    hashes = chain_block_hashes(list(prompt)[: len(prompt) - 1], BLOCK, salt=tenant)
    return {
        "arrival_s": arrival, "prompt_tokens": len(prompt), "output_tokens": 3,
        "max_tokens": 3, "tenant": tenant, "finish_reason": "length", "block_size": BLOCK,
        "block_hashes": [h.hex() for h in hashes],
    }  # fmt: skip


def _write(path: Path, lines: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


SYSTEM = list(range(100, 112))
"""Three blocks every captured prompt below starts with."""
CAPTURED = [
    [*SYSTEM, 1, 2, 3, 4, 5, 6, 7, 8, 9],  # blocks: S S S a b (+ 1 tail token)
    [*SYSTEM, 1, 2, 3, 4, 50, 60, 70, 80, 90, 91],  # S S S a c (+ 2)
    [*SYSTEM, 7, 7],  # S S S (+ 2)
    [500, 501, 502, 503, 504, 505, 506],  # x (+ 3): nothing in common
]
SHARED_BLOCKS = [[5, 4, 3, 0], [4, 5, 3, 0], [3, 3, 3, 0], [0, 0, 0, 1]]
"""Leading blocks captured prompt i and j share (a prompt with itself: all its blocks)."""


@pytest.fixture
def trace(tmp_path: Path) -> tuple[TraceEntry, ...]:
    lines = [_line(p, 0.1 * i) for i, p in enumerate(CAPTURED)]
    lines.append(_line([*SYSTEM, 1, 2, 3, 4, 5], 0.5, tenant="other"))  # another tenant's salt
    return load_trace(_write(tmp_path / "captured.jsonl", lines))


def test_shared_hashes_become_shared_leading_blocks(trace: tuple[TraceEntry, ...]) -> None:
    prompts = [r.prompt for r in Load(VOCAB, trace=trace, seed=3).plan(None).requests]
    assert [len(p) for p in prompts[:4]] == [len(p) for p in CAPTURED]
    for i in range(4):
        for j in range(4):
            if i != j:
                # Exactly the shared blocks, and different right after them.
                assert _common(prompts[i], prompts[j]) == SHARED_BLOCKS[i][j] * BLOCK, (i, j)
    # The tenant salts the hashes: the same tokens under another tenant share nothing.
    assert all(_common(prompts[4], p) == 0 for p in prompts[:4])
    assert all(FIRST_PROMPT_ID <= t < VOCAB for p in prompts for t in p)
    assert trace[0].prefix.tenant == "t" and trace[4].prefix.tenant == "other"


def test_the_tail_is_each_requests_own(tmp_path: Path) -> None:
    """Equal hashes and equal lengths: the same leading blocks, then different tokens."""
    line = _line([*SYSTEM, 1, 2, 3], 0.0)
    trace = load_trace(_write(tmp_path / "t.jsonl", [line, {**line, "arrival_s": 1.0}]))
    a, b = (r.prompt for r in Load(VOCAB, trace=trace).plan(None).requests)
    assert _common(a, b) == len(SYSTEM)
    assert len(a) == len(b) == len(SYSTEM) + 3


def test_deterministic_per_seed_and_new_per_rate(trace: tuple[TraceEntry, ...]) -> None:
    def prompts(seed: int, rate: float | None) -> list[tuple[int, ...]]:
        return [r.prompt for r in Load(VOCAB, trace=trace, seed=seed).plan(rate).requests]

    assert prompts(1, None) == prompts(1, None)
    assert prompts(1, 2.0) == prompts(1, 2.0)
    # Another seed, or another point of the same run: no block in common with this one.
    for other in (prompts(2, None), prompts(1, 2.0)):
        assert all(_common(a, b) == 0 for a, b in zip(prompts(1, None), other, strict=True))


def test_old_traces_replay_as_before(tmp_path: Path) -> None:
    rows = [(10, 5, 0.0), (20, 6, 1.0), (7, 2, 1.5)]
    old = load_trace(_write(tmp_path / "old.jsonl", [
        {"prompt_tokens": p, "output_tokens": o, "arrival_s": a} for p, o, a in rows
    ]))  # fmt: skip
    assert all(e.prefix == PromptPrefix() for e in old)
    plan = Load(VOCAB, trace=old, seed=4).plan(None)
    # The token stream of before: every prompt drawn in turn from the seed's token RNG.
    rng = random.Random("4:tokens:none")
    assert [r.prompt for r in plan.requests] == [
        tuple(make_prompts(rng, 1, p, VOCAB)[0]) for p, _, _ in rows
    ]
    # A tenant, a block size or an empty hash list alone change nothing.
    extra = load_trace(_write(tmp_path / "extra.jsonl", [
        {"prompt_tokens": p, "output_tokens": o, "arrival_s": a, "tenant": "x",
         "block_size": 16, "block_hashes": []} for p, o, a in rows
    ]))  # fmt: skip
    assert Load(VOCAB, trace=extra, seed=4).plan(None) == plan


def test_blocks_are_a_function_of_hash_size_and_key() -> None:
    h = bytes(range(16))
    a, b = BlockTokens(VOCAB, "k"), BlockTokens(VOCAB, "k")
    assert a.block(h, 8) == b.block(h, 8) and len(a.block(h, 8)) == 8
    assert a.block(h, 8) != BlockTokens(VOCAB, "other").block(h, 8)
    assert a.block(h, 8)[:4] != a.block(h, 4)
    prefix = PromptPrefix((h, h[::-1]), 4)
    prompt = a.prompt(prefix, 11, random.Random(0))
    assert prompt[:8] == [*a.block(h, 4), *a.block(h[::-1], 4)] and len(prompt) == 11
    with pytest.raises(InvalidArgumentError, match="block_hashes"):
        a.prompt(prefix, 7, random.Random(0))


GOOD = {"prompt_tokens": 9, "output_tokens": 2, "arrival_s": 0.0, "block_size": 4,
        "block_hashes": ["00ff", "a1b2"]}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_hashes": ["zz"]}, r"block_hashes\[0\] must be a non-empty hex string"),
        ({"block_hashes": ["00ff", "abc"]}, r"block_hashes\[1\] must be a non-empty hex"),
        ({"block_hashes": [""]}, r"block_hashes\[0\]"),
        ({"block_hashes": [7]}, r"block_hashes\[0\]"),
        ({"block_hashes": "00ff"}, "block_hashes must be a list"),
        ({"block_size": 0}, "block_size must be an integer >= 1"),
        ({"block_size": True}, "block_size must be an integer >= 1"),
        ({"block_size": 2.5}, "block_size must be an integer >= 1"),
        ({"block_size": None}, "block_size is needed with block_hashes"),
        ({"prompt_tokens": 8}, "block_hashes has 2 blocks of 4 tokens"),
        ({"block_hashes": ["00"] * 5, "block_size": 2}, "block_hashes has 5 blocks of 2"),
        ({"tenant": 5}, "tenant must be a string"),
    ],
)
def test_malformed_prefix_fields_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    path = _write(tmp_path / "bad.jsonl", [GOOD, {**GOOD, **change}])
    with pytest.raises(InvalidArgumentError, match=f"bad.jsonl:2: {message}"):
        load_trace(path)


def test_the_most_hashes_a_prompt_holds_are_accepted(tmp_path: Path) -> None:
    """``(prompt_tokens - 1) // block_size``: the last token is never in a block."""
    (entry,) = load_trace(_write(tmp_path / "t.jsonl", [GOOD]))
    assert entry.prefix.block_hashes == (b"\x00\xff", b"\xa1\xb2")
    assert entry.prefix.block_size == 4
