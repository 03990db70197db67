"""The grammar mask in the batched sampler: one bitmask for the rows that use a control,
filled by the guided rows' matchers only (one C++ call each), applied once; the other rows
come out exactly as they would without the guided ones beside them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.engine.guide import Guide
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

xgr = pytest.importorskip("xgrammar")

DIGITS = Guide.regex("[0-9]{1,4}")
CHOICES = Guide.choice(["yes", "no"])


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32")


def queued(engine: Engine, params: list[SamplingParams]) -> list[Sequence]:
    """Sequences of ``params`` as the engine makes them (seeds, generators, matchers)."""
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [1, 50 + i, 60 + i], p)
    seqs = list(engine.scheduler.waiting)
    for i in range(len(params)):
        engine.abort(f"r{i}")
    return seqs


class CountingMatcher:
    """A matcher that counts its bitmask fills (the rest goes to the real one)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.fills: list[int] = []

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.fills.append(row)
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.matcher, name)


def test_one_bitmask_is_filled_by_the_guided_rows_and_applied_once(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    applied: list[tuple[int, list[int] | None]] = []
    real_apply = xgr.apply_token_bitmask_inplace

    def counting_apply(logits: torch.Tensor, bitmask: torch.Tensor, **kw: Any) -> None:
        applied.append((logits.shape[0], kw.get("indices")))
        real_apply(logits, bitmask, **kw)

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", counting_apply)
    params = [
        SamplingParams(temperature=0.0, guide=DIGITS),  # guided, greedy
        SamplingParams(temperature=0.0),  # plain
        SamplingParams(temperature=0.0, logit_bias={7: 5.0}),  # controlled, not guided
        SamplingParams(temperature=1.0, seed=3, guide=CHOICES),  # guided, sampled
        SamplingParams(temperature=1.0, seed=4),  # plain, sampled
        SamplingParams(temperature=1.0, seed=5, min_tokens=2),  # controlled, sampled
    ]
    seqs = queued(engine, params)
    counters = {}
    for i, s in enumerate(seqs):
        if s.guide is not None:
            counters[i] = s.guide.matcher = CountingMatcher(s.guide.matcher)
    logits = torch.randn(len(seqs), 2048, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    mixed = sample(logits, seqs)

    # The controlled rows are 0, 2, 3, 5; the guided ones are the first and third of them.
    assert applied == [(4, [0, 2])]
    assert {i: c.fills for i, c in counters.items()} == {0: [0], 3: [2]}
    assert torch.equal(logits, before)  # the controls work on a copy
    assert not mixed.failed
    for i in counters:
        state = seqs[i].guide
        assert state is not None and mixed.tokens[i] in set(state.allowed_tokens().tolist())
    # Without the guided rows, every other row draws the same token.
    others = [1, 2, 4, 5]
    alone = sample(logits[others].clone(), [seqs[i] for i in others])
    assert [mixed.tokens[i] for i in others] == alone.tokens
    assert len(applied) == 1  # the batch without guided rows never reached the library


def test_the_guided_row_of_a_complete_grammar_can_only_end(engine: Engine) -> None:
    """Once ``yes`` is out, the choice is complete: only the end-of-sequence token is left,
    whatever the logits favour."""
    (seq,) = queued(engine, [SamplingParams(temperature=0.0, guide=CHOICES)])
    assert seq.guide is not None
    for token in engine.tokenizer.encode("yes", add_bos=False):
        assert not seq.guide.advance(token)
    logits = torch.zeros(1, 2048)
    logits[0, 100] = 50.0  # the model's favourite, which the grammar forbids
    (token,) = sample(logits, [seq]).tokens
    assert token in engine.tokenizer.eos_token_ids
    assert seq.guide.advance(token)  # the grammar has ended: the request stops


def test_a_guide_the_other_controls_leave_no_token_fails_its_row_alone(engine: Engine) -> None:
    """``min_tokens`` holds back the end-of-sequence token, which is all a complete grammar
    allows: that row has nothing to draw and fails alone, as a row whose controls mask all."""
    seqs = queued(
        engine,
        [
            SamplingParams(temperature=0.0, guide=CHOICES, min_tokens=5, max_tokens=8),
            SamplingParams(temperature=0.0),
        ],
    )
    guided = seqs[0].guide
    assert guided is not None
    for token in engine.tokenizer.encode("no", add_bos=False):
        guided.advance(token)
    seqs[0].token_ids += engine.tokenizer.encode("no", add_bos=False)
    out = sample(torch.randn(2, 2048), seqs)
    assert list(out.failed) == [0]
    assert "no token is left" in out.failed[0]
