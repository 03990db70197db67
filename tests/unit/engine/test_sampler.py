"""The sampler against every parameter value: what ``SamplingParams`` accepts samples without
error; what it refuses names the field; a row of non-finite logits fails alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.errors import InvalidArgumentError

VOCAB = 512

# Every double, the edges included: 0, subnormals, the largest finite, inf and NaN.
any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-320, 1e-300, 1e-45, 1e-38, GREEDY_TEMPERATURE,
                     1e-5 * (1 + 2**-52), 1.0, 1e38, 1e308, math.inf, -math.inf, math.nan]),
)  # fmt: skip
any_top_k = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, VOCAB - 1, VOCAB]))
any_seed = st.one_of(st.none(), st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63 - 1]))


def make_seq(params: SamplingParams, rid: str = "r", seed: int = 7) -> Sequence:
    seq = Sequence(rid, [1, 2, 3], params, arrival=0)
    if not params.greedy:
        seq.seed = params.seed if params.seed is not None else seed
        seq.generator = torch.Generator()
    return seq


def logits_of(seed: int, scale: float, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * scale


@settings(max_examples=300, deadline=None)
@given(
    temperature=any_float,
    top_p=any_float,
    top_k=any_top_k,
    seed=any_seed,
    logits_seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e4]),
)
def test_every_accepted_value_samples_and_every_refused_one_names_its_field(
    temperature: float, top_p: float, top_k: int, seed: int | None, logits_seed: int, scale: float
) -> None:
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except InvalidArgumentError as err:
        assert err.field in ("temperature", "top_p", "seed")
        bad = {
            "temperature": not (math.isfinite(temperature) and temperature >= 0),
            "top_p": not (0 < top_p <= 1),
            "seed": seed is not None and seed >= 2**63,
        }
        assert bad[err.field], (err, temperature, top_p, seed)
        return
    assert math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1
    logits = logits_of(logits_seed, scale)
    out = sample(logits, [make_seq(params)])
    assert out.failed == {}
    assert 0 <= out.tokens[0] < VOCAB
    assert math.isfinite(out.logprobs[0]) and out.logprobs[0] <= 0
    # One token is left to draw (at a huge temperature every logit is ~0: all tie for best).
    if params.greedy or ((top_k == 1 or top_p <= 1e-30) and temperature <= 100):
        assert logits[0, out.tokens[0]] == logits[0].max()


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_best_token() -> None:
    logits = logits_of(3, 5.0)
    best = int(logits[0].argmax())
    for params in (
        SamplingParams(temperature=1e-320),
        SamplingParams(temperature=GREEDY_TEMPERATURE / 2, top_k=5),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=1),
        SamplingParams(temperature=2.0, top_p=5e-324, seed=2),
    ):
        out = sample(logits, [make_seq(params)])
        assert out.failed == {} and out.tokens == [best], params


@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_of_non_finite_logits_fails_alone(greedy: bool) -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0 if greedy else 0.8, seed=11),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.9, seed=5),
    ]
    logits = logits_of(4, 3.0, rows=3)
    alone = sample(logits[[0, 2]], [make_seq(params[0], "a"), make_seq(params[2], "c")])
    for poison in (float("nan"), float("inf")):
        bad = logits.clone()
        bad[1, 17] = poison
        out = sample(bad, [make_seq(p, rid) for p, rid in zip(params, "abc", strict=True)])
        assert set(out.failed) == {1}
        assert [out.tokens[0], out.tokens[2]] == alone.tokens
        assert [out.logprobs[0], out.logprobs[2]] == alone.logprobs


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": -math.inf}, "top_p"),
        ({"top_p": None}, "top_p"),
        ({"top_k": True}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": ("ok", 3)}, "stop"),
        ({"stop_token_ids": (1, "2")}, "stop_token_ids"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # above max_tokens (16)
        ({"min_tokens": 1.0}, "min_tokens"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -math.inf}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
        ({"allowed_token_ids": (1, -2)}, "allowed_token_ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"bad_words": ("ok", " ")}, "bad_words"),
        ({"bad_words": (b"x",)}, "bad_words"),
        ({"bad_words_token_ids": ((1, 2), ())}, "bad_words_token_ids"),
        ({"bad_words_token_ids": ((1, True),)}, "bad_words_token_ids"),
    ],
)
def test_values_of_the_wrong_kind_name_their_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": (0, VOCAB)}, "allowed_token_ids"),
        ({"bad_words_token_ids": ((1, VOCAB),)}, "bad_words_token_ids"),
        ({"allowed_token_ids": (4, 5), "bad_words_token_ids": ((5,), (4,))}, "allowed_token_ids"),
    ],
)
def test_token_ids_are_checked_against_the_vocabulary(
    kwargs: dict[str, object], field: str
) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError) as e:
        params.check_against(vocab_size=VOCAB, max_model_len=100, prompt_len=3)
    assert e.value.field == field


def test_the_first_token_and_the_rest_keep_min_tokens() -> None:
    """A prefill draws the first token alone, still under ``min_tokens``; a request continued
    after ``n`` tokens owes ``n`` fewer."""
    p = SamplingParams(max_tokens=10, min_tokens=4)
    assert (p.first_token_only().max_tokens, p.first_token_only().min_tokens) == (1, 1)
    assert (p.after(3).max_tokens, p.after(3).min_tokens) == (7, 1)
    assert p.after(6).min_tokens == 0
    assert SamplingParams().first_token_only().min_tokens == 0
