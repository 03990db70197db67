"""Proto <-> domain conversions: defaults, round trips, and errors that name the field."""

from __future__ import annotations

import pytest

from pdserve import convert
from pdserve.engine.guide import Guide
from pdserve.engine.outputs import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.v1 import common_pb2 as pb


def test_unset_fields_take_the_engine_defaults() -> None:
    assert convert.sampling_from_proto(pb.SamplingParams()) == SamplingParams()


def test_sampling_round_trip_keeps_every_field() -> None:
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        seed=123,
        max_tokens=33,
        stop_token_ids=(3, 9),
        stop=("\n\n", "END"),
        ignore_eos=True,
        presence_penalty=-0.5,
        frequency_penalty=1.25,
        repetition_penalty=1.5,
        min_p=0.125,
        min_tokens=4,
        logit_bias={7: 100.0, 8: -2.5},
        allowed_token_ids=(7, 8, 9),
        bad_words=("gosh",),
        bad_words_token_ids=((1,), (2, 3)),
    )
    msg = convert.sampling_to_proto(params)
    back = convert.sampling_from_proto(pb.SamplingParams.FromString(msg.SerializeToString()))
    assert back == params
    assert back.seed == 123 and back.stop == ("\n\n", "END")


@pytest.mark.parametrize(
    "guide",
    [
        Guide.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        Guide.json_object(),
        Guide.regex("[a-z]+"),
        Guide.choice(["yes", "no", "peut-être"]),
        Guide.grammar('root ::= "x" | "y"'),
    ],
)
def test_each_guide_travels_under_its_vllm_field(guide: Guide) -> None:
    msg = convert.sampling_to_proto(SamplingParams(guide=guide))
    assert [f.name for f, _ in msg.ListFields() if f.name.startswith("guided_")] == [
        guide.kind.field
    ]
    back = convert.sampling_from_proto(pb.SamplingParams.FromString(msg.SerializeToString()))
    assert back.guide == guide
    assert convert.sampling_to_proto(SamplingParams()).ListFields() == (
        convert.sampling_to_proto(SamplingParams(guide=None)).ListFields()
    )


def test_explicit_zero_temperature_is_greedy_not_default() -> None:
    # temperature is `optional`: 0 set on purpose must differ from "unset" (default 1.0).
    params = convert.sampling_from_proto(pb.SamplingParams(temperature=0.0))
    assert params.greedy


def test_unset_repetition_penalty_is_off() -> None:
    assert convert.sampling_from_proto(pb.SamplingParams()).repetition_penalty == 1.0
    assert convert.sampling_to_proto(SamplingParams()).repetition_penalty == 1.0


def test_seed_absent_stays_none() -> None:
    msg = convert.sampling_to_proto(SamplingParams(seed=None))
    assert not msg.HasField("seed")
    assert convert.sampling_from_proto(msg).seed is None


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (pb.SamplingParams(max_tokens=0), "sampling.max_tokens"),
        (pb.SamplingParams(temperature=-1.0), "sampling.temperature"),
        (pb.SamplingParams(temperature=float("nan")), "sampling.temperature"),
        (pb.SamplingParams(temperature=float("inf")), "sampling.temperature"),
        (pb.SamplingParams(top_p=float("nan")), "sampling.top_p"),
        (pb.SamplingParams(top_p=float("-inf")), "sampling.top_p"),
        (pb.SamplingParams(top_p=0.0), "sampling.top_p"),
        (pb.SamplingParams(top_p=1.5), "sampling.top_p"),
        (pb.SamplingParams(seed=2**63), "sampling.seed"),
        (pb.SamplingParams(stop=["ok", ""]), "sampling.stop"),
        (pb.SamplingParams(presence_penalty=2.5), "sampling.presence_penalty"),
        (pb.SamplingParams(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
        # optional: an explicit 0 is refused, not taken for "unset" (1, off)
        (pb.SamplingParams(repetition_penalty=0.0), "sampling.repetition_penalty"),
        (pb.SamplingParams(min_p=1.5), "sampling.min_p"),
        (pb.SamplingParams(min_tokens=17), "sampling.min_tokens"),  # above max_tokens (16)
        (pb.SamplingParams(logit_bias={5: 101.0}), "sampling.logit_bias"),
        (pb.SamplingParams(bad_words=[" "]), "sampling.bad_words"),
        (
            pb.SamplingParams(bad_words_token_ids=[pb.TokenIds(ids=[])]),
            "sampling.bad_words_token_ids",
        ),
        (pb.SamplingParams(guided_json="{"), "sampling.guided_json"),  # not JSON
        (pb.SamplingParams(guided_json="[1, 2]"), "sampling.guided_json"),  # not a schema
        (pb.SamplingParams(guided_json="[" * 5000), "sampling.guided_json"),  # beyond Python's
        (  # deeper than MAX_SCHEMA_DEPTH: its compile would take seconds
            pb.SamplingParams(guided_json='{"items": ' * 129 + "{}" + "}" * 129),
            "sampling.guided_json",
        ),
        (pb.SamplingParams(guided_choice=["a", ""]), "sampling.guided_choice"),
        # Two guides: the second is named.
        (pb.SamplingParams(guided_json="{}", guided_regex="a"), "sampling.guided_regex"),
        (pb.SamplingParams(guided_json_object=True, guided_grammar="x"), "sampling.guided_grammar"),
    ],
)
def test_invalid_sampling_names_the_field(msg: pb.SamplingParams, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        convert.sampling_from_proto(msg)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_prefix_is_configurable() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        convert.sampling_from_proto(pb.SamplingParams(max_tokens=0), field="params")
    assert info.value.field == "params.max_tokens"


def test_check_against_model_limits_names_the_field() -> None:
    params = SamplingParams(max_tokens=100, stop_token_ids=(7,))
    convert.check_sampling_against(params, vocab_size=10, max_model_len=200, prompt_len=100)
    with pytest.raises(InvalidArgumentError) as info:
        convert.check_sampling_against(params, vocab_size=10, max_model_len=200, prompt_len=101)
    assert info.value.field == "sampling.max_tokens"
    with pytest.raises(InvalidArgumentError) as info:
        convert.check_sampling_against(params, vocab_size=7, max_model_len=200, prompt_len=1)
    assert info.value.field == "sampling.stop_token_ids"


def test_check_token_ids() -> None:
    assert convert.check_token_ids((1, 2, 3), vocab_size=4, field="ids") == [1, 2, 3]
    with pytest.raises(InvalidArgumentError, match="ids: must contain"):
        convert.check_token_ids([], vocab_size=4, field="ids")
    with pytest.raises(InvalidArgumentError, match="token id 4 at position 1") as info:
        convert.check_token_ids([0, 4], vocab_size=4, field="prompt.ids")
    assert info.value.field == "prompt.ids"


@pytest.mark.parametrize("reason", list(FinishReason))
def test_finish_reason_round_trip(reason: FinishReason) -> None:
    wire = convert.finish_reason_to_proto(reason)
    assert wire != pb.FINISH_REASON_UNSPECIFIED
    assert convert.finish_reason_from_proto(wire) is reason
    assert convert.finish_reason_name(wire) == reason.value


def test_finish_reason_unspecified_means_running() -> None:
    assert convert.finish_reason_to_proto(None) == pb.FINISH_REASON_UNSPECIFIED
    assert convert.finish_reason_from_proto(pb.FINISH_REASON_UNSPECIFIED) is None
    assert convert.finish_reason_name(pb.FINISH_REASON_UNSPECIFIED) is None


def test_finish_reason_error_and_unknown_values() -> None:
    assert convert.finish_reason_name(pb.FINISH_REASON_ERROR) == "error"
    with pytest.raises(InvalidArgumentError) as info:
        convert.finish_reason_from_proto(pb.FINISH_REASON_ERROR, field="chunk.finish_reason")
    assert info.value.field == "chunk.finish_reason"
    for convert_fn in (convert.finish_reason_from_proto, convert.finish_reason_name):
        with pytest.raises(InvalidArgumentError, match="finish_reason"):
            convert_fn(99)


def test_enums_reject_values_the_schema_does_not_name() -> None:
    # Proto3 enums are open: an unknown number parses, so readers must check it.
    assert convert.mode_from_proto(pb.MODE_COLOCATED) == pb.MODE_COLOCATED
    assert convert.role_from_proto(pb.WORKER_ROLE_MIXED) == pb.WORKER_ROLE_MIXED
    with pytest.raises(InvalidArgumentError) as info:
        convert.mode_from_proto(7, field="request.mode")
    assert info.value.field == "request.mode"
    with pytest.raises(InvalidArgumentError):
        convert.role_from_proto(-1)


def test_mode_names() -> None:
    assert convert.mode_from_name("Colocated") == pb.MODE_COLOCATED
    assert convert.mode_from_name("disaggregated") == pb.MODE_DISAGGREGATED
    with pytest.raises(InvalidArgumentError, match="mode"):
        convert.mode_from_name("both")


def test_usage_fits_uint32() -> None:
    u = convert.usage_to_proto(prompt_tokens=3, completion_tokens=4, cached_tokens=1)
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (3, 4, 1)
    with pytest.raises(InvalidArgumentError) as info:
        convert.usage_to_proto(prompt_tokens=-1, completion_tokens=0)
    assert info.value.field == "usage.prompt_tokens"


def test_timing_to_dict_lists_every_field() -> None:
    d = convert.timing_to_dict(pb.Timing(ttft_ms=1.5, transport="store"))
    assert d["ttft_ms"] == 1.5 and d["transport"] == "store" and d["e2e_ms"] == 0.0
    assert set(d) == {f.name for f in pb.Timing.DESCRIPTOR.fields}
