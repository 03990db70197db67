"""``bench serve --features``: what a target's requests carry (a JSON schema, penalties), how
each target sends it, how answers the grammar ends early count, and the report's cost table."""

from __future__ import annotations

import asyncio
from typing import Any

import jsonschema
import pytest

from pdserve.client.request import build_request
from pdserve.errors import InvalidArgumentError
from pdserve_bench.serve.cli import parser
from pdserve_bench.serve.cli_targets import labels
from pdserve_bench.serve.features import (
    JSON_SCHEMA,
    PENALTIES,
    PLAIN,
    RECORD_SCHEMA,
    get_features,
)
from pdserve_bench.serve.metrics import Slo
from pdserve_bench.serve.mixes import SHORT_ONLY
from pdserve_bench.serve.openai import OpenAITarget
from pdserve_bench.serve.records import RequestRecord, Status
from pdserve_bench.serve.report import feature_costs, format_report
from pdserve_bench.serve.runner import run_point
from pdserve_bench.serve.sweep import run_all
from pdserve_bench.serve.workload import Load

from .fakes import GRAMMAR_ENDS_AFTER, FakeOpenAI, FakeTarget, url_of


def _point(target: OpenAITarget, load: Load) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        await target.open()
        try:
            return await run_point(target, load.plan(None), request_timeout_s=30.0)
        finally:
            await target.close()

    return asyncio.run(go())


def test_json_schema_requests_carry_the_schema_and_may_end_early(
    openai_server: FakeOpenAI,
) -> None:
    load = Load(1000, mix=SHORT_ONLY, num_requests=3, burst=0, seed=1)
    records = _point(OpenAITarget(url_of(openai_server), "j", features=JSON_SCHEMA), load)
    for rec in records:  # the grammar ended each answer after 3 of its 48-96 tokens
        assert rec.status is Status.OK, rec.error
        assert rec.output_tokens == GRAMMAR_ENDS_AFTER
    for body in openai_server.bodies:
        fmt = body["response_format"]
        assert fmt["type"] == "json_schema"
        assert fmt["json_schema"]["schema"] == RECORD_SCHEMA
        assert body["ignore_eos"] is True and "min_tokens" not in body


def test_a_short_answer_without_a_grammar_is_an_error(openai_server: FakeOpenAI) -> None:
    """Plain requests are held to exactly max_tokens: the fake ends early only on a
    response_format, so a plain target sent one would be caught."""

    class Cheating(OpenAITarget):
        def body(self, prompt: Any, max_tokens: int) -> dict[str, Any]:
            return {**super().body(prompt, max_tokens), "response_format": {"type": "text"}}

    load = Load(1000, mix=SHORT_ONLY, num_requests=2, burst=0, seed=1)
    records = _point(Cheating(url_of(openai_server), "c"), load)
    assert all(r.status is Status.ERROR for r in records)
    assert all(f"got {GRAMMAR_ENDS_AFTER} of" in r.error for r in records)


def test_penalties_send_min_tokens_equal_to_max_tokens(openai_server: FakeOpenAI) -> None:
    load = Load(1000, mix=SHORT_ONLY, num_requests=3, burst=0, seed=1)
    records = _point(OpenAITarget(url_of(openai_server), "p", features=PENALTIES), load)
    assert all(r.status is Status.OK for r in records)
    for body in openai_server.bodies:
        assert body["min_tokens"] == body["max_tokens"]
        assert body["presence_penalty"] == 0.5 and body["frequency_penalty"] == 0.5
        assert body["repetition_penalty"] == 1.1


def test_sdk_options_are_the_same_fields_and_build_a_request() -> None:
    opts = JSON_SCHEMA.sdk_options(40)
    assert opts == {"guided_json": RECORD_SCHEMA}
    req = build_request([1, 2, 3], max_tokens=40, **opts)
    assert req.sampling.guided_json  # the schema travels as JSON text
    opts = PENALTIES.sdk_options(40)
    req = build_request([1, 2, 3], max_tokens=40, **opts)
    assert req.sampling.min_tokens == 40
    assert req.sampling.presence_penalty == pytest.approx(0.5)
    assert req.sampling.repetition_penalty == pytest.approx(1.1)
    assert PLAIN.sdk_options(40) == {} and PLAIN.openai_fields(40) == {}


def test_the_record_schema_is_a_valid_bounded_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(RECORD_SCHEMA)
    ok = {"name": "a", "age": 3, "role": "admin", "active": True, "tags": ["x"]}
    jsonschema.validate(ok, RECORD_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**ok, "tags": ["x"] * 5}, RECORD_SCHEMA)


def test_the_command_line_gives_features_per_target() -> None:
    args = parser().parse_args([
        "--openai-url", "http://a:1", "--openai-url", "http://a:1", "--features", "json-schema",
        "--router", "r:1", "--features", "penalties", "--label", "pen",
    ])  # fmt: skip
    assert [t.features for t in args.targets] == ["plain", "json-schema", "penalties"]
    assert labels(args) == ["openai-a:1", "openai-a:1+json-schema", "pen"]
    with pytest.raises(SystemExit):
        parser().parse_args(["--features", "penalties", "--router", "r:1"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--router", "r:1", "--features", "beam-search"])
    with pytest.raises(InvalidArgumentError, match="features"):
        get_features("beam-search")


def test_the_report_prices_features_against_the_same_servers_plain_requests() -> None:
    plain, slow = FakeTarget("plain"), FakeTarget("schema", lambda _r: 0.5)
    slow.features = JSON_SCHEMA  # same "server" (describe() is the same), other features
    other = FakeTarget("alone")
    other.features = PENALTIES
    other.describe = lambda: {"kind": "fake", "url": "elsewhere"}  # type: ignore[method-assign]
    load = Load(1000, mix=SHORT_ONLY, num_requests=10)
    targets = [plain, slow, other]
    result = asyncio.run(
        run_all(targets, load, rates=[50.0], search=None, slo=Slo(), request_timeout_s=30.0)
    )
    rows = feature_costs(result, targets)
    assert rows[0][:3] == ["target", "against", "req/s"]
    assert [r[:3] for r in rows[1:]] == [["schema (json-schema)", "plain", "50"]]
    # half the schema target's requests were refused: half the tokens of the plain ones
    cell = {(p.target, p.rate): p.summary for p in result.points}
    ratio = cell[("schema", 50.0)].throughput_tok_s / cell[("plain", 50.0)].throughput_tok_s
    assert rows[1][3] == f"{ratio:.2f}x"
    text = format_report(result, targets, slo=Slo(), headline="H")
    assert "cost of the features" in text and "requests carry: response_format" in text


def test_featured_targets_get_the_same_shapes_with_other_tokens() -> None:
    load = Load(1000, mix=SHORT_ONLY, num_requests=6, seed=3)
    plain, schema = load.plan(2.0), load.plan(2.0, salt=JSON_SCHEMA.salt)
    assert PLAIN.salt == "" and load.plan(2.0, salt=PLAIN.salt) == plain
    assert [(r.arrival_s, len(r.prompt), r.output_tokens) for r in plain.requests] == [
        (r.arrival_s, len(r.prompt), r.output_tokens) for r in schema.requests
    ]
    assert all(a.prompt != b.prompt for a, b in zip(plain.requests, schema.requests, strict=True))
    assert load.plan(2.0, salt=JSON_SCHEMA.salt) == schema  # every server: the same tokens
