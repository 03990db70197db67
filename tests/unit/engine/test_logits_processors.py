"""The logits controls against independent references on the same logits: HF transformers'
logits processors where the definition is the same (repetition penalty, min-p, min new tokens,
bad words, a one-token sequence bias), a straightforward per-row formula for OpenAI's presence
and frequency penalties; several requests in one batch, each with its own controls. Then the
sampler around them: greedy rows are controlled too, the logprob stays the raw model's, a batch
without controls never reaches them, a row they mask entirely fails alone."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from pdserve.engine import logits_processors, sampler
from pdserve.engine.logits_processors import apply_controls, is_controlled, min_p_filter
from pdserve.engine.sampler import sample, step_seed
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

VOCAB = 256


def seq_of(params: SamplingParams, prompt: list[int], output: list[int], seed: int = 3) -> Sequence:
    seq = Sequence("r", prompt, params, arrival=0)
    seq.token_ids += output
    if not params.greedy:
        seq.seed, seq.generator = seed, torch.Generator()
    return seq


def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """``n`` rows of logits with both signs, and a prompt and an output per row that repeat
    tokens (so that counts above 1 occur)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * 4
    prompts = [torch.randint(0, VOCAB // 4, (20 + 7 * i,), generator=g).tolist() for i in range(n)]
    outputs = [torch.randint(0, 24, (6 + 3 * i,), generator=g).tolist() for i in range(n)]
    return logits, prompts, outputs


def controlled(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return apply_controls(logits.clone(), seqs)


def test_repetition_penalty_matches_hf() -> None:
    """Over the prompt and the output tokens; each row its own penalty (1.0: untouched)."""
    logits, prompts, outputs = batch(4)
    penalties = [1.3, 0.6, 1.0, 2.0]
    seqs = [
        seq_of(SamplingParams(repetition_penalty=r, logit_bias={0: 0.0}), p, o)
        for r, p, o in zip(penalties, prompts, outputs, strict=True)
    ]
    got = controlled(logits, seqs)
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)
    assert not torch.equal(got[0], logits[0])  # the penalty changed something


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    """logits[t] -= frequency * count_out[t] + presence * (count_out[t] > 0), output only."""
    logits, prompts, outputs = batch(3)
    settings = [(0.5, 0.25), (-2.0, 2.0), (1.5, -1.0)]
    seqs = [
        seq_of(SamplingParams(presence_penalty=pp, frequency_penalty=fp), p, o)
        for (pp, fp), p, o in zip(settings, prompts, outputs, strict=True)
    ]
    got = controlled(logits, seqs)
    for i, (pp, fp) in enumerate(settings):
        want = logits[i].clone()
        for token, count in Counter(outputs[i]).items():
            want[token] = want[token] - fp * count - pp
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
        assert any(c > 1 for c in Counter(outputs[i]).values())  # counts above 1 occur
        untouched = sorted(set(prompts[i]) - set(outputs[i]))
        assert torch.equal(got[i, untouched], logits[i, untouched])  # the prompt does not count


def test_all_penalties_together_match_vllm_order() -> None:
    """Repetition first (HF's processor), then frequency and presence (the formula)."""
    logits, prompts, outputs = batch(2, seed=5)
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3)
    got = controlled(logits, [seq_of(params, p, o) for p, o in zip(prompts, outputs, strict=True)])
    for i in range(2):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[i : i + 1].clone())[0]
        for token, count in Counter(outputs[i]).items():
            want[token] = want[token] - 0.3 * count - 0.4
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_matches_hf_after_temperature(min_p: float) -> None:
    logits, _, _ = batch(4, seed=7)
    scaled = TemperatureLogitsWarper(0.7)(None, logits.clone())  # type: ignore[arg-type]
    want = MinPLogitsWarper(min_p)(None, scaled.clone())  # type: ignore[arg-type]
    got = min_p_filter(logits / 0.7, min_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_seeded_min_p_draws_what_hf_processed_distribution_draws() -> None:
    """Token for token: the same seeded draw from HF's processed distribution."""
    logits, prompts, outputs = batch(6, seed=11)
    for i in range(6):
        params = SamplingParams(temperature=0.9, min_p=0.1, seed=100 + i)
        seq = seq_of(params, prompts[i], outputs[i], seed=100 + i)
        got = sample(logits[i : i + 1], [seq]).tokens[0]
        scaled = TemperatureLogitsWarper(0.9)(None, logits[i : i + 1].clone())  # type: ignore[arg-type]
        probs = torch.softmax(MinPLogitsWarper(0.1)(None, scaled), dim=-1)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(step_seed(100 + i, len(outputs[i])))
        assert got == int(torch.multinomial(probs[0], 1, generator=g)[0])


def test_seeded_draws_with_controls_match_hf_processed_distribution() -> None:
    """Bias and repetition penalty before temperature, min-p after it (vLLM's order, HF's
    processors chained so): the same seeded draw, row by row of one batch."""
    logits, prompts, outputs = batch(5, seed=21)
    seqs = [
        seq_of(
            SamplingParams(
                temperature=1.3, min_p=0.05, repetition_penalty=1.5, logit_bias={i: 2.0},
                seed=40 + i,
            ),
            prompts[i], outputs[i], seed=40 + i,
        )
        for i in range(5)
    ]  # fmt: skip
    got = sample(logits, seqs).tokens
    for i in range(5):
        ids = torch.tensor([prompts[i] + outputs[i]])
        row = SequenceBiasLogitsProcessor([[[i], 2.0]])(ids, logits[i : i + 1].clone())
        row = RepetitionPenaltyLogitsProcessor(1.5)(ids, row)
        row = TemperatureLogitsWarper(1.3)(ids, row)
        probs = torch.softmax(MinPLogitsWarper(0.05)(ids, row), dim=-1)
        g = torch.Generator().manual_seed(step_seed(40 + i, len(outputs[i])))
        assert got[i] == int(torch.multinomial(probs[0], 1, generator=g)[0])


def test_min_tokens_matches_hf_min_new_tokens() -> None:
    """The stop tokens (EOS among them) are masked while the output is shorter."""
    logits, prompts, outputs = batch(3, seed=2)
    stops = (2, 17, 40)
    for i, min_tokens in enumerate([len(outputs[0]) + 1, len(outputs[1]), 50]):
        params = SamplingParams(min_tokens=min_tokens, max_tokens=60, stop_token_ids=stops)
        seq = seq_of(params, prompts[i], outputs[i])
        processor = MinNewTokensLengthLogitsProcessor(len(prompts[i]), min_tokens, list(stops))
        want = processor(torch.tensor([prompts[i] + outputs[i]]), logits[i : i + 1].clone())[0]
        assert is_controlled(seq) == (len(outputs[i]) < min_tokens)
        got = controlled(logits[i : i + 1], [seq])[0] if is_controlled(seq) else logits[i]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_words_match_hf_on_the_output() -> None:
    """vLLM matches a word's prefix against the output only: HF's processor on the output
    tokens. One-token words always, longer words when the output ends with their prefix."""
    logits, prompts, outputs = batch(3, seed=4)
    words = [
        [(9,), (outputs[0][-1], 33), (outputs[0][-2], outputs[0][-1], 34), (1, 2, 35)],
        [(outputs[1][-1],), (outputs[1][-3], outputs[1][-2], 36)],
        [(prompts[2][-1], 37)],  # the prompt's end is no prefix: nothing masked but 9 above
    ]
    seqs = [
        seq_of(SamplingParams(bad_words_token_ids=tuple(w)), p, o)
        for w, p, o in zip(words, prompts, outputs, strict=True)
    ]
    got = controlled(logits, seqs)
    for i in range(3):
        hf = NoBadWordsLogitsProcessor([list(w) for w in words[i]])
        want = hf(torch.tensor([outputs[i]]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)
    assert math.isinf(got[0, 33]) and math.isinf(got[0, 34]) and not math.isinf(got[0, 35])
    assert not torch.isinf(got[2]).any()


def test_logit_bias_matches_hf_sequence_bias_of_one_token() -> None:
    logits, prompts, outputs = batch(2, seed=8)
    bias = [{3: 100.0, 4: -100.0, 5: 0.25}, {3: -7.5}]
    got = controlled(
        logits,
        [
            seq_of(SamplingParams(logit_bias=b), p, o)
            for b, p, o in zip(bias, prompts, outputs, strict=True)
        ],
    )
    for i, b in enumerate(bias):
        hf = SequenceBiasLogitsProcessor([[[t], v] for t, v in b.items()])
        want = hf(torch.tensor([prompts[i] + outputs[i]]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)


def test_allowed_token_ids_keep_only_those() -> None:
    logits, prompts, outputs = batch(2, seed=9)
    seqs = [
        seq_of(SamplingParams(allowed_token_ids=(4, 200, 4)), prompts[0], outputs[0]),
        seq_of(SamplingParams(logit_bias={1: 1.0}), prompts[1], outputs[1]),  # no list: all
    ]
    got = controlled(logits, seqs)
    assert torch.equal(got[0, [4, 200]], logits[0, [4, 200]])
    assert torch.isinf(got[0]).sum() == VOCAB - 2
    assert not torch.isinf(got[1]).any()


def test_the_controls_compose_in_vllm_order() -> None:
    """allowed -> bad words -> min_tokens -> bias -> penalties, as HF's processors chained."""
    logits, prompts, outputs = batch(1, seed=12)
    prompt, output = prompts[0], outputs[0]
    allowed = tuple(range(0, 120))
    params = SamplingParams(
        allowed_token_ids=allowed, bad_words_token_ids=((7,), (output[-1], 8)), min_tokens=40,
        max_tokens=40, stop_token_ids=(2,), logit_bias={output[0]: 3.0, 9: -2.0},
        repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.2,
    )  # fmt: skip
    got = controlled(logits, [seq_of(params, prompt, output)])[0]
    want = torch.full((VOCAB,), -math.inf)
    want[list(allowed)] = logits[0, list(allowed)]
    want = NoBadWordsLogitsProcessor([[7], [output[-1], 8]])(
        torch.tensor([output]), want.unsqueeze(0)
    )
    ids = torch.tensor([prompt + output])
    want = MinNewTokensLengthLogitsProcessor(len(prompt), 40, [2])(ids, want)
    want = SequenceBiasLogitsProcessor([[[output[0]], 3.0], [[9], -2.0]])(ids, want)
    want = RepetitionPenaltyLogitsProcessor(1.4)(ids, want)[0]
    for token, count in Counter(output).items():
        want[token] = want[token] - 0.2 * count - 0.5
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_greedy_rows_are_controlled_and_report_the_raw_logprob() -> None:
    logits, prompts, outputs = batch(3, seed=13)
    plain = SamplingParams(temperature=0.0)
    forced = SamplingParams(temperature=0.0, logit_bias={77: 100.0})
    seqs = [seq_of(p, prompts[i], outputs[i]) for i, p in enumerate([plain, forced, plain])]
    out = sample(logits, seqs)
    assert out.tokens == [int(logits[0].argmax()), 77, int(logits[2].argmax())]
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx([float(raw[i, t]) for i, t in enumerate(out.tokens)])
    assert out.failed == {}


def test_a_batch_without_controls_takes_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("apply_controls on a batch without controls")

    monkeypatch.setattr(sampler, "apply_controls", refuse)
    logits, prompts, outputs = batch(3, seed=14)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=1),  # min_p: the draw's
        SamplingParams(temperature=0.0, min_tokens=2, max_tokens=9),  # already past it
    ]
    seqs = [seq_of(p, prompts[i], outputs[i]) for i, p in enumerate(params)]
    assert sample(logits, seqs).failed == {}


def test_a_row_with_every_token_masked_fails_alone() -> None:
    logits, prompts, outputs = batch(3, seed=15)
    for temperature in (0.0, 0.7):
        dead = SamplingParams(
            temperature=temperature, seed=1, allowed_token_ids=(5, 6),
            bad_words_token_ids=((outputs[1][-1], 5),), min_tokens=20, max_tokens=20,
            stop_token_ids=(6,),
        )  # fmt: skip
        live = SamplingParams(temperature=0.0, logit_bias={8: 100.0})
        seqs = [seq_of(p, prompts[i], outputs[i]) for i, p in enumerate([live, dead, live])]
        out = sample(logits, seqs)
        assert set(out.failed) == {1} and "mask" in out.failed[1]
        assert (out.tokens[0], out.tokens[2]) == (8, 8)


def test_flat_indices_keep_repeats_and_rows() -> None:
    rows, ids = logits_processors._index([(0, [5, 5, 9]), (3, []), (2, [1])], torch.device("cpu"))
    assert rows.tolist() == [0, 0, 0, 2] and ids.tolist() == [5, 5, 9, 1]
