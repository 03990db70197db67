"""Greedy generation with logits controls matches HF transformers' ``generate`` token for token
on the same checkpoint: ``repetition_penalty``, ``min_tokens`` (HF's ``min_new_tokens``, the
stop token an extra ``eos_token_id``) and bad words (``bad_words_ids``). The requests run in one
engine batch, beside a request without controls, and each is compared with HF alone. Each
control is also checked to change the output, so a parity that held without it proves nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.engine.logits_processors import tokenize_bad_words
from pdserve.engine.sampling_params import SamplingParams
from tests.unit.engine.hf_reference import HFReference

EOS = 2  # the demo checkpoints'
N = 16


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> HFReference:
    return HFReference(tiny_llama_dir)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2048, (length,), generator=g).tolist() for _ in range(n)]


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """All of ``requests`` in one engine run (batched together); their output tokens."""
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    engine.check_no_leaks()
    return list(out.values())


@torch.inference_mode()
def hf_generate(hf: HFReference, prompt: list[int], **kwargs: object) -> list[int]:
    """HF's greedy output, cut after its first end token (HF pads a finished row)."""
    ends = kwargs.get("eos_token_id", EOS)
    ends = set(ends) if isinstance(ends, list) else {ends}
    ids = hf.model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # no token is padding
        do_sample=False,
        max_new_tokens=N,
        pad_token_id=3,
        **kwargs,
    )[0, len(prompt) :].tolist()
    for i, t in enumerate(ids):
        if t in ends:
            return ids[: i + 1]
    return ids


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, **kwargs)  # type: ignore[arg-type]


def test_repetition_penalty_matches_hf_generate(engine: Engine, hf: HFReference) -> None:
    """Long random prompts: the model's likely tokens are among the prompt's, so the penalty
    (on prompt and output tokens) changes the greedy path."""
    ps = prompts(3, 200, seed=0)
    cases = [(ps[0], 1.3), (ps[1], 0.7), (ps[2], 1.3)]
    got = run(engine, [(p, greedy(repetition_penalty=r)) for p, r in cases] + [(ps[0], greedy())])
    plain = got[-1]
    for (p, r), tokens in zip(cases, got, strict=False):
        assert tokens == hf_generate(hf, p, repetition_penalty=r)
    assert got[0] != plain, "the penalty was meant to change the output"


def test_min_tokens_matches_hf_min_new_tokens(engine: Engine, hf: HFReference) -> None:
    """The stop token is the one the request would stop at at once; min_tokens holds it (and
    EOS) back for that many tokens."""
    ps = prompts(2, 30, seed=1)
    firsts = [tokens[0] for tokens in run(engine, [(p, greedy()) for p in ps])]
    stopping = [greedy(stop_token_ids=(s,)) for s in firsts]
    assert [len(t) for t in run(engine, list(zip(ps, stopping, strict=True)))] == [1, 1]
    held = [greedy(stop_token_ids=(s,), min_tokens=k) for s, k in zip(firsts, [5, 9], strict=True)]
    got = run(engine, [*zip(ps, held, strict=True), (ps[0], greedy())])
    for p, s, k, tokens in zip(ps, firsts, [5, 9], got, strict=False):
        assert len(tokens) > k or len(tokens) == N
        assert tokens == hf_generate(hf, p, eos_token_id=[EOS, s], min_new_tokens=k)


def test_bad_words_match_hf_bad_words_ids(engine: Engine, hf: HFReference) -> None:
    """One-token words never appear; a two-token word's second token is masked after its
    first. HF matches a prefix against the prompt too, vLLM (and pdserve) the output only: no
    word here starts with the prompt's last token, so the two agree."""
    ps = prompts(2, 25, seed=2)
    plain = run(engine, [(p, greedy()) for p in ps])
    singles = [((t[0],), (t[2],)) for t in plain]
    first = run(
        engine, [(p, greedy(bad_words_token_ids=w)) for p, w in zip(ps, singles, strict=True)]
    )
    words = [(*w, (t[3], t[4])) for w, t in zip(singles, first, strict=True)]
    got = run(
        engine,
        [
            *((p, greedy(bad_words_token_ids=w)) for p, w in zip(ps, words, strict=True)),
            (ps[1], greedy()),
        ],
    )
    for p, w, tokens, before in zip(ps, words, got, first, strict=False):
        assert all(word[0] != p[-1] for word in w)
        assert tokens == hf_generate(hf, p, bad_words_ids=[list(x) for x in w])
        assert tokens[:4] == before[:4] and tokens[4] != before[4]  # the pair was cut there
        assert w[0][0] not in tokens and w[1][0] not in tokens


def test_bad_words_as_text_are_tokenized_as_vllm_does(engine: Engine) -> None:
    """Each word alone, and after a space when that gives other tokens of the same count
    (the word inside a text); leading spaces of the word itself are dropped first."""
    tok = engine.tokenizer

    def enc(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_bos=False))

    params = tokenize_bad_words(
        SamplingParams(bad_words=("  hello", "world peace"), bad_words_token_ids=((7,),)), tok
    )
    assert params.bad_words == ()
    expected = [(7,), enc("hello")]
    if enc(" hello")[0] != enc("hello")[0] and len(enc(" hello")) == len(enc("hello")):
        expected.append(enc(" hello"))
    expected.append(enc("world peace"))
    if len(enc(" world peace")) == len(enc("world peace")):
        expected.append(enc(" world peace"))
    assert list(params.bad_words_token_ids) == expected
    assert len(expected) == 4  # this tokenizer: " hello" differs, " world peace" is shorter
