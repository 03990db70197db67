"""The router's per-request limits: each names its field, on the domain values and on the
wire message (by counts, before its repeated fields are copied), and a request within every
limit fits the message size the router's gRPC server accepts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.engine.guide import Guide
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.router import ModelLimits, RequestLimits, RequestPreparer, prepare_request
from pdserve.router.limits import RECEIVE_FACTOR, RECEIVE_FLOOR_BYTES, check_message
from pdserve.rpc.sizes import MAX_MESSAGE_BYTES
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, router_pb2
from services.router.__main__ import parse_args, request_limits, server_options

LIMITS = RequestLimits(
    max_prompt_tokens=50, max_prompt_bytes=300, max_stop_strings=3, max_stop_chars=20,
    max_stop_token_ids=4, max_logit_bias=3, max_allowed_token_ids=5, max_bad_words=2,
    max_bad_words_chars=6, max_guide_chars=12, max_guided_choices=4, max_request_id_chars=10,
    max_tenant_chars=8,
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> ModelLimits:
    return ModelLimits.from_dir(tiny_llama_dir)


OVER_A_LIMIT: list[tuple[dict[str, object], str]] = [
    ({"token_ids": [5] * 51}, "token_ids"),
    ({"text": "a" * 301}, "text"),
    ({"text": "é" * 151}, "text"),  # 151 characters, 302 bytes
    ({"text": "hi", "stop": ["a", "b", "c", "d"]}, "sampling.stop"),
    ({"text": "hi", "stop": ["a" * 15, "b" * 6]}, "sampling.stop"),
    ({"text": "hi", "stop_token_ids": [1, 2, 3, 4, 5]}, "sampling.stop_token_ids"),
    ({"text": "hi", "logit_bias": {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}}, "sampling.logit_bias"),
    ({"text": "hi", "allowed_token_ids": [1, 2, 3, 4, 5, 6]}, "sampling.allowed_token_ids"),
    ({"text": "hi", "bad_words": ["a", "b", "c"]}, "sampling.bad_words"),
    ({"text": "hi", "bad_words": ["abcd", "efg"]}, "sampling.bad_words"),
    (
        {"text": "hi", "bad_words_token_ids": [[1, 2, 3, 4], [5, 6, 7]]},
        "sampling.bad_words_token_ids",
    ),
    ({"text": "hi", "guided_json": '{"type": "str"}'}, "sampling.guided_json"),
    ({"text": "hi", "guided_regex": "[a-z]{1,10000}"}, "sampling.guided_regex"),
    ({"text": "hi", "guided_grammar": 'root ::= "abc"'}, "sampling.guided_grammar"),
    ({"text": "hi", "guided_choice": ["abcdefg", "hijklm"]}, "sampling.guided_choice"),
    ({"text": "hi", "guided_choice": ["a"] * 5}, "sampling.guided_choice"),
    ({"text": "hi", "request_id": "r" * 11}, "request_id"),
    ({"text": "hi", "tenant": "t" * 9}, "tenant"),
]


def _message(case: dict[str, object]) -> tuple[router_pb2.GenerateRequest, str]:
    msg = router_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(
            stop=case.get("stop", []),  # type: ignore[arg-type]
            stop_token_ids=case.get("stop_token_ids", []),  # type: ignore[arg-type]
            logit_bias=case.get("logit_bias", {}),  # type: ignore[arg-type]
            allowed_token_ids=case.get("allowed_token_ids", []),  # type: ignore[arg-type]
            bad_words=case.get("bad_words", []),  # type: ignore[arg-type]
            bad_words_token_ids=[
                common_pb2.TokenIds(ids=w)
                for w in case.get("bad_words_token_ids", [])  # type: ignore[attr-defined]
            ],
            guided_json=case.get("guided_json", ""),  # type: ignore[arg-type]
            guided_regex=case.get("guided_regex", ""),  # type: ignore[arg-type]
            guided_choice=case.get("guided_choice", []),  # type: ignore[arg-type]
            guided_grammar=case.get("guided_grammar", ""),  # type: ignore[arg-type]
        )
    )
    if "text" in case:
        msg.text = str(case["text"])
    else:
        msg.token_ids.ids.extend(case["token_ids"])  # type: ignore[arg-type]
    if "request_id" in case:
        msg.request_id = str(case["request_id"])
    return msg, str(case.get("tenant", ""))


@pytest.mark.parametrize(("case", "field"), OVER_A_LIMIT)
def test_each_limit_names_its_field(
    tokenizer: Tokenizer, model: ModelLimits, case: dict[str, object], field: str
) -> None:
    params = SamplingParams(
        stop=tuple(case.get("stop", ())),  # type: ignore[arg-type]
        stop_token_ids=tuple(case.get("stop_token_ids", ())),  # type: ignore[arg-type]
        logit_bias=case.get("logit_bias", {}),  # type: ignore[arg-type]
        allowed_token_ids=tuple(case.get("allowed_token_ids", ())),  # type: ignore[arg-type]
        bad_words=tuple(case.get("bad_words", ())),  # type: ignore[arg-type]
        bad_words_token_ids=tuple(map(tuple, case.get("bad_words_token_ids", ()))),  # type: ignore[call-overload]
        guide=Guide.from_fields(
            guided_json=case.get("guided_json", ""),  # type: ignore[arg-type]
            guided_regex=case.get("guided_regex", ""),  # type: ignore[arg-type]
            guided_choice=case.get("guided_choice", ()),  # type: ignore[arg-type]
            guided_grammar=case.get("guided_grammar", ""),  # type: ignore[arg-type]
        ),
    )
    with pytest.raises(InvalidArgumentError) as info:
        prepare_request(
            text=case.get("text"),  # type: ignore[arg-type]
            token_ids=case.get("token_ids"),  # type: ignore[arg-type]
            params=params,
            tokenizer=tokenizer,
            limits=model,
            request_limits=LIMITS,
            request_id=case.get("request_id"),  # type: ignore[arg-type]
            tenant=str(case.get("tenant", "")),
        )
    assert info.value.field == field
    msg, tenant = _message(case)
    with pytest.raises(InvalidArgumentError) as info:
        check_message(msg, LIMITS, tenant=tenant)
    assert info.value.field == field


def test_everything_at_its_limit_passes(tokenizer: Tokenizer, model: ModelLimits) -> None:
    stop = ("a" * 10, "b" * 9, "c")
    for case in ({"token_ids": [5] * 50}, {"text": "é" * 150}):
        req = prepare_request(
            text=case.get("text"),  # type: ignore[arg-type]
            token_ids=case.get("token_ids"),  # type: ignore[arg-type]
            params=SamplingParams(stop=stop, stop_token_ids=(1, 2, 3, 4), max_tokens=1),
            tokenizer=tokenizer,
            limits=model,
            request_limits=LIMITS,
            request_id="r" * 10,
            tenant="t" * 8,
        )
        assert req.request_id == "r" * 10 and req.params.stop == stop
        msg, _ = _message({**case, "stop": stop, "stop_token_ids": [1, 2, 3, 4]})
        check_message(msg, LIMITS, tenant="t" * 8)


def test_a_request_within_every_limit_fits_the_message_bound() -> None:
    for limits in (LIMITS, RequestLimits.for_model(4096), RequestLimits.for_model(131072)):
        widest = "\U0001f642"  # four bytes of UTF-8 per character
        n_stops = limits.max_stop_strings
        sampling = common_pb2.SamplingParams(
            temperature=1.5, top_k=2**32 - 1, top_p=0.5, seed=2**63 - 1, max_tokens=2**32 - 1,
            stop_token_ids=[2**32 - 1] * limits.max_stop_token_ids,
            stop=[widest * (limits.max_stop_chars // n_stops)] * n_stops,
            ignore_eos=True,
            presence_penalty=-1.5, frequency_penalty=1.5, repetition_penalty=1.5, min_p=0.5,
            min_tokens=2**32 - 1,
            logit_bias={2**32 - 1 - i: -99.5 for i in range(limits.max_logit_bias)},
            allowed_token_ids=[2**32 - 1] * limits.max_allowed_token_ids,
            # As token ids, the widest form of the bad words (5 bytes an id, 4 a character).
            bad_words_token_ids=[
                common_pb2.TokenIds(ids=[2**32 - 1] * (limits.max_bad_words_chars // n_words))
                for n_words in [limits.max_bad_words] for _ in range(n_words)
            ],
            # The widest guide: its characters spread over as many choices as it may have.
            guided_choice=[widest * (limits.max_guide_chars // limits.max_guided_choices)]
            * limits.max_guided_choices,
        )  # fmt: skip
        common = {
            "sampling": sampling,
            "request_id": widest * limits.max_request_id_chars,
            "skip_special_tokens": True,
            "tenant": widest * limits.max_tenant_chars,
        }
        by_ids = router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=[2**32 - 1] * limits.max_prompt_tokens), **common
        )
        by_text = router_pb2.GenerateRequest(text="x" * limits.max_prompt_bytes, **common)
        bound = limits.max_message_bytes()
        assert by_ids.ByteSize() <= bound and by_text.ByteSize() <= bound
        if limits is not LIMITS:  # a real model's: no multiple of what fits, not even twice
            assert bound < 2 * max(by_ids.ByteSize(), by_text.ByteSize())


def test_the_router_receives_far_more_than_fits_so_that_oversize_is_named() -> None:
    """A prompt over its limit by any realistic factor reaches the check that names the field
    (a 60,000-word prompt to a 2K-token model was refused unparsed, as if for load)."""
    small = RequestLimits.for_model(2048)
    sixty_thousand_words = router_pb2.GenerateRequest(text="lorem " * 60_000)
    assert sixty_thousand_words.ByteSize() > small.max_message_bytes()
    assert sixty_thousand_words.ByteSize() < small.receive_bytes() == RECEIVE_FLOOR_BYTES
    with pytest.raises(InvalidArgumentError, match=r"^text: .* takes 32768 at most$"):
        check_message(sixty_thousand_words, small, tenant="t")
    large = RequestLimits.for_model(131072)  # RECEIVE_FACTOR times its largest message
    assert large.receive_bytes() == RECEIVE_FACTOR * large.max_message_bytes() < MAX_MESSAGE_BYTES
    # Capped at what any pdserve process receives, unless a request within the limits needs more.
    assert RequestLimits.for_model(1 << 20).receive_bytes() == MAX_MESSAGE_BYTES
    huge = RequestLimits.for_model(4096, max_prompt_bytes=2 * MAX_MESSAGE_BYTES)
    assert huge.receive_bytes() == huge.max_message_bytes() > MAX_MESSAGE_BYTES


def test_limits_come_from_the_flags(model: ModelLimits) -> None:
    default = request_limits(parse_args(["--scheduler", "x:1", "--model", "m"]), model)
    assert default == RequestLimits.for_model(model.max_model_len)
    assert default.max_prompt_tokens == model.max_model_len
    args = parse_args(["--scheduler", "x:1", "--model", "m", "--max-stop-strings", "2",
                       "--max-prompt-bytes", "999", "--max-guide-chars", "77"])  # fmt: skip
    limits = request_limits(args, model)
    assert (limits.max_stop_strings, limits.max_prompt_bytes) == (2, 999)
    assert limits.max_guide_chars == 77
    assert dict(server_options(limits))["grpc.max_receive_message_length"] == (
        limits.receive_bytes()
    )
    with pytest.raises(InvalidArgumentError) as info:
        request_limits(
            parse_args(["--scheduler", "x:1", "--model", "m", "--max-stop-chars", "0"]), model
        )
    assert info.value.field == "--max-stop-chars"


def test_preparer_tokenizes_long_text_off_the_loop_to_the_same_ids(
    tokenizer: Tokenizer, model: ModelLimits
) -> None:
    words = "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 40  # 2280 characters
    preparer = RequestPreparer(tokenizer, model, inline_chars=100)
    params = SamplingParams(max_tokens=1)

    async def body() -> None:
        for text in (words[:80], words):  # inline, then on the preparer's threads
            req = await preparer.prepare(text=text, token_ids=None, params=params)
            assert list(req.prompt_token_ids) == tokenizer.encode(text)
        with pytest.raises(InvalidArgumentError) as info:
            await preparer.prepare(text=words, token_ids=None, params=params, tenant="a b")
        assert info.value.field == "tenant"

    try:
        asyncio.run(body())
    finally:
        preparer.close()
    assert tokenizer.encode(words, release_gil=True) == tokenizer.encode(words)
