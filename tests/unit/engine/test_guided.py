"""Structured output in the engine (``engine.guided``), on the tiny random-weight model sampled
at temperature 1: every output of a guided request is in its grammar and ends with finish
reason stop, across seeds, batched, through a hand-off, a migration and a preemption; a
guide that does not compile is refused naming its field before anything is queued."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.guide import Guide
from pdserve.engine.guide_probe import JSON_WHITESPACE, GuideProbe
from pdserve.engine.guided import Guides
from pdserve.engine.outputs import FinishReason, GenerationResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import FeatureUnavailableError, InvalidArgumentError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "nick": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "nick", "age", "color", "ok", "tags"],
    "additionalProperties": False,
}
"""Every valid instance is short (bounded strings, enums, a bounded integer and array); the
random model still pads it with whitespace, which JSON allows, hence the generous
``max_tokens`` of the tests."""
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ("yes", "no", "maybe so")
GRAMMAR = 'root ::= "(" item (", " item)* ")"\nitem ::= [a-z] | [0-9]'
GRAMMAR_TEXT = re.compile(r"\([a-z0-9](, [a-z0-9])*\)")
PROMPT = "tell me about a person"
SEEDS = range(30)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32")


def sampled(guide: Guide, seed: int, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, guide=guide)


def assert_valid(result: GenerationResult, schema: dict[str, object] = SCHEMA) -> None:
    assert result.finish_reason is FinishReason.STOP, (result.finish_reason, result.text)
    jsonschema.validate(json.loads(result.text), schema)


def test_every_output_of_a_schema_request_validates(engine: Engine) -> None:
    guide = Guide.json_schema(SCHEMA)
    results = engine.generate([PROMPT] * len(SEEDS), [sampled(guide, s) for s in SEEDS])
    for result in results:
        assert_valid(result)
    assert len({r.text for r in results}) > len(SEEDS) // 2  # sampled, not one answer
    engine.check_no_leaks()


@pytest.mark.parametrize(
    ("guide", "matches"),
    [
        (Guide.regex(REGEX), lambda text: re.fullmatch(REGEX, text)),
        (Guide.choice(CHOICES), lambda text: text in CHOICES),
        (Guide.grammar(GRAMMAR), GRAMMAR_TEXT.fullmatch),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_regex_choice_and_grammar_outputs_match(
    engine: Engine, guide: Guide, matches: Callable[[str], object]
) -> None:
    results = engine.generate([PROMPT] * 20, [sampled(guide, s, 64) for s in range(20)])
    for r in results:
        assert r.finish_reason is FinishReason.STOP and matches(r.text), r.text
    assert len({r.text for r in results}) > 1


def test_json_object_outputs_are_objects(engine: Engine) -> None:
    """Any object: unbounded, so a random model may run out of ``max_tokens`` inside one;
    every output that ends is an object, and most do."""
    results = engine.generate(["{"] * 20, [sampled(Guide.json_object(), s, 256) for s in range(20)])
    ended = [r for r in results if r.finish_reason is FinishReason.STOP]
    assert len(ended) >= 5
    for r in ended:
        assert isinstance(json.loads(r.text), dict), r.text
    for r in results:
        assert r.text.startswith("{")


def test_greedy_requests_follow_the_guide_too(engine: Engine) -> None:
    """The random model's arg-max is whitespace wherever JSON allows it: the bound on each
    run of it (``JSON_WHITESPACE``) is what ends its output."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1000, guide=Guide.json_schema(SCHEMA))
    result = engine.generate(PROMPT, greedy)[0]
    assert_valid(result)
    assert max(len(w) for w in re.findall(r"\s+", result.text)) <= JSON_WHITESPACE


def run_import(
    engine: Engine, rid: str, prompt: list[int], params: SamplingParams, **kw
) -> list[int]:  # type: ignore[no-untyped-def]
    engine.add_request(rid, prompt, params, **kw)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                assert out.finish_reason is FinishReason.STOP
    return tokens


def test_another_engine_continues_the_grammar_after_a_hand_off(
    engine: Engine, tiny_llama_dir: Path
) -> None:
    """The decode side (another engine, its own compile) replays the prefill's first token, or
    a migrated request's tokens, into a fresh matcher: its seeded draws then continue the
    undisturbed run token for token, so the output is the same valid instance."""
    guide = Guide.json_schema(SCHEMA)
    prompt = engine.tokenizer.encode(PROMPT)
    decode = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    for seed in range(4):
        params = sampled(guide, seed)
        whole = engine.generate(prompt, params)[0]
        assert_valid(whole)
        engine.add_request("p", prompt, params.first_token_only(), hold_kv=True)
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                first = (out.new_token_ids[0], out.new_logprobs[0])
        kv = engine.export_kv("p")
        engine.release_kv("p")
        assert first is not None and first[0] == whole.token_ids[0]
        rest = run_import(decode, "d", prompt, params, kv=kv, first_token=first)
        assert [first[0], *rest] == whole.token_ids
        cut = len(whole.token_ids) // 2
        moved = run_import(decode, "m", prompt, params, generated=whole.token_ids[:cut])
        assert moved == whole.token_ids[cut:]
        decode.check_no_leaks()
    engine.check_no_leaks()


def test_a_preempted_sequence_keeps_its_matcher(engine: Engine, tiny_llama_dir: Path) -> None:
    """A pool too small for the batch preempts (and recomputes) guided sequences: their
    outputs are the unpreempted ones, all valid."""
    guide = Guide.json_schema(SCHEMA)
    params = [sampled(guide, s) for s in range(8)]
    roomy = engine.generate([PROMPT] * 8, params)
    small = Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=60, block_size=8)
    tight = small.generate([PROMPT] * 8, params)
    assert small.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]
    for r in tight:
        assert_valid(r)
    small.check_no_leaks()


def test_drawn_tokens_outside_the_grammar_are_refused(engine: Engine) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    params = sampled(Guide.json_schema(SCHEMA), 0)
    outside = engine.tokenizer.encode("[", add_bos=False)  # an object must start with "{"
    with pytest.raises(InvalidArgumentError) as err:
        engine.add_request("bad", prompt, params, generated=outside)
    assert err.value.field == "generated"
    ended = engine.tokenizer.encode("yes", add_bos=False) + list(engine.tokenizer.eos_token_ids)
    choice = SamplingParams(max_tokens=8, ignore_eos=True, guide=Guide.choice(CHOICES))
    with pytest.raises(InvalidArgumentError, match="already ended") as err:
        engine.add_request("done", prompt, choice, generated=ended)
    assert err.value.field == "generated"
    engine.check_no_leaks()


@pytest.mark.parametrize(
    ("guide", "field"),
    [
        (Guide.regex("(["), "guided_regex"),
        (Guide.regex(r"(a)\1"), "guided_regex"),  # back-references: not supported
        (Guide.grammar('root ::= "a" |'), "guided_grammar"),
        (Guide.grammar('start ::= "a"'), "guided_grammar"),  # no root rule
        (Guide.json_schema({"type": "nonsense"}), "guided_json"),
        (Guide.json_schema({"$ref": "#/$defs/missing"}), "guided_json"),
    ],
)
def test_a_guide_that_does_not_compile_is_refused_by_field(
    engine: Engine, guide: Guide, field: str
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        engine.add_request("x", PROMPT, SamplingParams(guide=guide))
    assert err.value.field == field
    assert "/" not in str(err.value).split(":", 1)[0]  # no C++ source path in front
    engine.check_no_leaks()


def test_a_guide_that_crashes_the_compiler_is_refused_and_the_engine_goes_on(
    engine: Engine,
) -> None:
    """xgrammar 0.2.8's compiler ends its process on this grammar (a segmentation fault): the
    probe's child process takes the crash, the guide is refused, and the next guide gets a
    new child."""
    probe = engine.guides.probe
    engine.guides.compile(Guide.regex("[0-9]"))  # the probe runs
    started = probe.started
    crash = SamplingParams(guide=Guide.grammar("root ::= root {2}"))
    with pytest.raises(InvalidArgumentError, match="crashes the grammar library") as err:
        engine.add_request("crash", PROMPT, crash)
    assert err.value.field == "guided_grammar"
    fine = engine.generate(PROMPT, sampled(Guide.grammar('root ::= "ok" | "fine"'), 0, 8))[0]
    assert fine.text in ("ok", "fine") and probe.started == started + 1
    engine.check_no_leaks()


def test_a_guide_the_probe_takes_too_long_over_is_refused() -> None:
    probe = GuideProbe()
    try:
        probe.check(Guide.regex("[a-z]+"))  # started and answered
        probe.timeout_s = 1e-9
        with pytest.raises(InvalidArgumentError, match="did not compile within") as err:
            probe.check(Guide.json_schema(SCHEMA))
        assert err.value.field == "guided_json"
        probe.timeout_s = 30.0
        with pytest.raises(InvalidArgumentError, match="Unclosed") as err:
            probe.check(Guide.regex("(["))  # its own refusals come with xgrammar's message
        assert err.value.field == "guided_regex" and probe.started == 2
    finally:
        probe.close()


class SlowDyingProbe(GuideProbe):
    """A child that says it is ready, closes its output on the first guide and exits a
    second later: its output ends before the kernel has its exit status."""

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            code = (
                "import os, sys, time; print('ready', flush=True); sys.stdin.readline(); "
                "os.close(1); time.sleep(1); os._exit(7)"
            )
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            self._ready = False
            self.started += 1
        return self._proc


def test_a_child_whose_output_ends_is_a_crash_with_its_exit_status() -> None:
    """The end of the child's output marks it dead, not ``poll()``: read just after the end,
    the process may still be running (here for a second), which was reported as a timeout."""
    probe = SlowDyingProbe(timeout_s=60.0)
    try:
        with pytest.raises(InvalidArgumentError, match=r"crashes .* \(exit status 7\)") as err:
            probe.check(Guide.regex("[a-z]+"))
        assert err.value.field == "guided_regex"
    finally:
        probe.close()


def test_compiled_guides_are_cached_and_bounded(tiny_llama_dir: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    guides = engine.guides
    schema = Guide.json_schema(SCHEMA)
    assert guides.compile(schema) is guides.compile(schema)
    assert guides.compiles == 1
    small = Guides(engine.tokenizer, 2048, cache_bytes=1)  # keeps the newest one only
    regex = Guide.regex(REGEX)
    small.compile(schema), small.compile(regex), small.compile(regex)
    assert small.compiles == 2
    small.compile(schema)
    assert small.compiles == 3  # evicted by the regex


def test_without_xgrammar_a_guide_is_refused_naming_the_extra(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import raises ImportError
    fresh = Guides(engine.tokenizer, 2048, cache_bytes=1 << 20)
    with pytest.raises(FeatureUnavailableError, match=r"pdserve\[structured\]") as err:
        fresh.compile(Guide.regex(REGEX))
    assert str(err.value).startswith("guided_regex: ")
    assert err.value.grpc_code == "FAILED_PRECONDITION"


def test_the_vocabulary_is_read_as_xgrammar_reads_it(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    """pdserve describes its tokenizer to xgrammar without transformers: the same decoded
    vocabulary and metadata as xgrammar's Hugging Face reader, but for the special tokens,
    which pdserve leaves empty so that no guided text contains one."""
    xgr = pytest.importorskip("xgrammar")
    transformers = pytest.importorskip("transformers")
    for model_dir in (tiny_llama_dir, tiny_qwen2_dir):
        engine = Engine.from_pretrained(model_dir, dtype="float32")
        ours = engine.guides.compile(Guide.regex("a")).tokenizer_info
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        theirs = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=2048, stop_token_ids=list(engine.tokenizer.eos_token_ids)
        )
        assert (ours.vocab_type, ours.add_prefix_space) == (
            theirs.vocab_type,
            theirs.add_prefix_space,
        )
        special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
        assert special and set(ours.special_token_ids) >= special - set(ours.stop_token_ids)
        for i, (a, b) in enumerate(zip(ours.decoded_vocab, theirs.decoded_vocab, strict=True)):
            assert a == (b"" if i in special else b), i
