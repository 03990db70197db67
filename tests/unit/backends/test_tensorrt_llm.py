"""The tensorrt-llm backend beyond the common contract: its translations of TensorRT-LLM's
objects, the arguments it builds the engine with, a hand-off between two engine instances
(as between a prefill and a decode worker), and what happens when the package is absent."""

from __future__ import annotations

import dataclasses
import math
import sys
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.backends import TENSORRT_LLM, Handoff, NativeKV
from pdserve.backends.tensorrt_llm_api import (
    MISSING,
    TensorRTLLMConfig,
    finish_reason,
    generation_params,
    kv_stats,
    load_api,
    native_of,
    new_logprobs,
    read_shape,
    unavailable,
)
from pdserve.backends.tensorrt_llm_sampling import sampling_params
from pdserve.engine.guide import JSON_OBJECT_SCHEMA, Guide
from pdserve.engine.outputs import FinishReason
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import (
    InvalidArgumentError,
    KVTransferError,
    ModelLoadError,
    WorkerUnavailableError,
)
from tests.unit.backends.conftest import open_backend, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
VOCAB = 2048  # the tiny model's


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import fails as when absent
    with pytest.raises(WorkerUnavailableError, match="NVIDIA publishes"):
        load_api()
    reason = unavailable()
    assert reason is not None and reason.startswith(MISSING)


def _sp(api: Any, params: SamplingParams, **kwargs: Any) -> Any:
    return sampling_params(api, params, prompt_len=3, vocab_size=VOCAB, **kwargs)


def test_greedy_and_sampled_parameters(fake_tensorrt_llm: Path) -> None:
    api = load_api()
    greedy = _sp(
        api, SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=(9,), stop=("x",))
    )
    assert (greedy.top_k, greedy.temperature, greedy.max_tokens) == (1, None, 7)
    assert greedy.stop_token_ids == [9] and greedy.stop == ["x"] and greedy.logprobs == 1
    sampled = _sp(
        api,
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11, ignore_eos=True),
        max_tokens=1,
    )
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.seed) == (0.7, 5, 0.9, 11)
    assert sampled.max_tokens == 1 and sampled.ignore_eos
    plain = _sp(api, SamplingParams(temperature=1.0))
    assert (plain.top_k, plain.top_p, plain.stop_token_ids, plain.stop) == (None, None, None, None)
    assert (plain.min_p, plain.min_tokens, plain.embedding_bias, plain.bad_token_ids) == (
        None, None, None, None,
    )  # fmt: skip
    assert (plain.presence_penalty, plain.repetition_penalty) == (None, None)


def test_logits_controls_map_to_their_namesakes(fake_tensorrt_llm: Path) -> None:
    api = load_api()
    sp = _sp(
        api,
        SamplingParams(
            temperature=0.8, min_p=0.1, min_tokens=4, repetition_penalty=1.3,
            presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={7: 2.5, 9: -100},
            bad_words_token_ids=((11,), (12,)),
        ),
    )  # fmt: skip
    assert (sp.min_p, sp.min_tokens, sp.repetition_penalty) == (0.1, 4, 1.3)
    # pdserve's presence and frequency penalties count the output only: the prompt is ignored.
    assert (sp.presence_penalty, sp.frequency_penalty, sp.prompt_ignore_length) == (0.5, -0.25, 3)
    assert sp.bad_token_ids == [11, 12]
    assert sp.embedding_bias.shape == (VOCAB,) and sp.embedding_bias.dtype == torch.float32
    assert sp.embedding_bias[7] == 2.5 and sp.embedding_bias[9] == -100
    assert int((sp.embedding_bias != 0).sum()) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"allowed_token_ids": (5, 6)}, "sampling.allowed_token_ids"),
        ({"bad_words_token_ids": ((5, 6),)}, "sampling.bad_words_token_ids"),
        ({"bad_words": ("hello",)}, "sampling.bad_words"),
        ({"min_tokens": 2, "stop_token_ids": (5,)}, "sampling.min_tokens"),
        ({"min_tokens": 2, "stop": ("x",)}, "sampling.min_tokens"),
        ({"logprobs": 3}, "sampling.logprobs"),
        ({"prompt_logprobs": 0}, "sampling.prompt_logprobs"),
    ],
)
def test_what_tensorrt_llm_cannot_express_is_refused_by_name(
    fake_tensorrt_llm: Path, tiny_llama_dir: Path, kwargs: dict[str, Any], field: str
) -> None:
    """Refused before anything reaches TensorRT-LLM, on every path: generate and prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=4, **kwargs)
    with pytest.raises(InvalidArgumentError) as err:
        _sp(load_api(), params)
    assert err.value.field == field

    async def body() -> None:
        async with open_backend(TENSORRT_LLM, tiny_llama_dir) as backend:
            stream = backend.generate(EngineRequest("g", [5, 6, 7], params))
            with pytest.raises(InvalidArgumentError) as e:
                async with aclosing(stream):
                    async for _ in stream:
                        pass
            assert e.value.field == field
            with pytest.raises(InvalidArgumentError) as e:
                await backend.prefill(EngineRequest("p", [5, 6, 7], params), handoff=Handoff.NATIVE)
            assert e.value.field == field

    run(body)


def test_guides_map_to_guided_decoding_params(fake_tensorrt_llm: Path) -> None:
    """A schema, a regex and a grammar map to their namesakes; a choice to the grammar of its
    strings; a JSON object to the schema of any object (as pdserve's own engine reads it)."""
    api = load_api()
    cases = [
        (Guide.json_schema('{"type": "integer"}'), {"json": '{"type": "integer"}'}),
        (Guide.json_object(), {"json": JSON_OBJECT_SCHEMA}),
        (Guide.regex("[a-z]+"), {"regex": "[a-z]+"}),
        (Guide.choice(["yes", 'a "b"']), {"grammar": 'root ::= "yes" | "a \\"b\\""'}),
        (Guide.grammar('root ::= "x"'), {"grammar": 'root ::= "x"'}),
    ]
    for guide, fields in cases:
        sp = _sp(api, SamplingParams(temperature=0.0, guide=guide))
        assert sp.guided_decoding == api.GuidedDecodingParams(**fields), guide
    assert _sp(api, SamplingParams()).guided_decoding is None
    # The syntax is checked before TensorRT-LLM compiles it (it would fail the request later).
    with pytest.raises(InvalidArgumentError) as err:
        _sp(api, SamplingParams(guide=Guide.regex("([")))
    assert err.value.field == "sampling.guided_regex"
    kwargs = TensorRTLLMConfig().llm_kwargs(api, Path("/model"))
    assert kwargs["guided_decoding_backend"] == "xgrammar"
    with pytest.raises(InvalidArgumentError) as err:
        TensorRTLLMConfig(guided_decoding_backend="outlines")
    assert err.value.field == "guided_decoding_backend"


def test_controls_reach_the_engine(fake_tensorrt_llm: Path, tiny_llama_dir: Path) -> None:
    """Through TensorRT-LLM's parameters (here the stand-in, which computes with pdserve's
    engine): a +100 bias forces its token; min_tokens holds back the end token."""
    prompt = [5, 77, 300, 1024, 9, 18]

    async def body() -> None:
        async with open_backend(TENSORRT_LLM, tiny_llama_dir) as backend:
            forced = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={42: 100.0})
            tokens = [
                t
                async for o in backend.generate(EngineRequest("b", prompt, forced))
                for t in o.new_token_ids
            ]
            assert tokens == [42] * 5
            # A bias of +100 on the end token ends the request at once, unless min_tokens.
            eos = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={2: 100.0})
            ended = [
                t
                async for o in backend.generate(EngineRequest("e", prompt, eos))
                for t in o.new_token_ids
            ]
            assert ended == [2]
            held = dataclasses.replace(eos, min_tokens=4)
            tokens = [
                t
                async for o in backend.generate(EngineRequest("m", prompt, held))
                for t in o.new_token_ids
            ]
            assert len(tokens) == 5 and 2 not in tokens[:4] and tokens[4] == 2

    run(body)


def test_native_handle_round_trip(fake_tensorrt_llm: Path) -> None:
    api = load_api()
    out = api.DisaggregatedParams(
        request_type="context_only", first_gen_tokens=[42], ctx_request_id=7, opaque_state=b"st"
    )
    kv = native_of(out)
    assert kv == NativeKV(TENSORRT_LLM, 7, (42,), b"st", ())
    back = generation_params(api, kv)
    assert back.request_type == "generation_only"
    assert (back.first_gen_tokens, back.ctx_request_id, back.opaque_state) == ([42], 7, b"st")
    assert back.draft_tokens is None
    with pytest.raises(KVTransferError):
        native_of(api.DisaggregatedParams(request_type="context_only", ctx_request_id=7))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("stop", FinishReason.STOP), ("length", FinishReason.LENGTH),
     ("cancelled", FinishReason.ABORT)],
)  # fmt: skip
def test_finish_reasons(value: str | None, expected: FinishReason | None) -> None:
    assert finish_reason(value, "r") is expected


def test_timeout_and_unknown_finishes_are_errors() -> None:
    with pytest.raises(KVTransferError, match="timed out on 'r'"):
        finish_reason("timeout", "r")
    with pytest.raises(WorkerUnavailableError, match="'weird'"):
        finish_reason("weird", "r")


def test_logprobs_align_with_the_end_of_the_tokens() -> None:
    class Lp:
        def __init__(self, logprob: float) -> None:
            self.logprob = logprob

    ids = [10, 11, 12, 13]
    assert new_logprobs([-0.1, -0.2, -0.3, -0.4], ids, 2) == [-0.3, -0.4]
    # A generation-only output leaves the context's first token out: one entry short.
    dicts: list[Any] = [{11: Lp(-0.2)}, {12: Lp(-0.3), 5: Lp(-9.0)}, {13: -0.4}]
    assert new_logprobs(dicts, ids, 1) == [-0.2, -0.3, -0.4]
    missing = new_logprobs([{99: Lp(-1.0)}], ids, 3)
    assert len(missing) == 1 and math.isnan(missing[0])
    assert all(math.isnan(x) for x in new_logprobs(None, ids, 0))


def test_kv_stats_of_dicts_and_json() -> None:
    stat = {"kvCacheStats": {"maxNumBlocks": 100, "freeNumBlocks": 60, "tokensPerBlock": 32}}
    got = kv_stats(stat)
    assert got is not None and (got.blocks_total, got.blocks_free, got.block_size) == (100, 60, 32)
    used = kv_stats('{"kvCacheStats": {"maxNumBlocks": 10, "usedNumBlocks": 4}}')
    assert used is not None and (used.blocks_free, used.block_size) == (6, 0)
    assert kv_stats({"iter": 3}) is None


def test_config_is_checked_by_field() -> None:
    for field, value in [("max_num_seqs", 0), ("free_gpu_memory_fraction", 1.5),
                         ("dtype", "float8"), ("stats_interval_s", 0.0)]:  # fmt: skip
        with pytest.raises(InvalidArgumentError) as err:
            TensorRTLLMConfig(**{field: value})  # type: ignore[arg-type]
        assert err.value.field == field


def test_engine_arguments(fake_tensorrt_llm: Path, tiny_llama_dir: Path) -> None:
    """The engine is built with a cache transceiver (context-only and generation-only requests
    need one) and iteration statistics (capacity), and with the sizes asked for."""
    api = load_api()
    config = TensorRTLLMConfig(
        block_size=16, kv_max_tokens=4096, max_num_seqs=8, transceiver="UCX", dtype="float32"
    )
    kwargs = config.llm_kwargs(api, tiny_llama_dir)
    assert kwargs["enable_iter_perf_stats"] is True
    assert kwargs["cache_transceiver_config"].backend == "UCX"
    kv = kwargs["kv_cache_config"]
    assert (kv.tokens_per_block, kv.max_tokens) == (16, 4096)
    assert kwargs["max_batch_size"] == 8 and "max_seq_len" not in kwargs

    async def body() -> None:
        async with open_backend(TENSORRT_LLM, tiny_llama_dir, block_size=16) as backend:
            cap = backend.capacity()
            assert cap.block_size == 16 and cap.blocks_total > 0
            assert backend.layout.block_size == 16 and backend.layout.dtype == "float32"

    run(body)


def test_hand_off_between_two_engines(fake_tensorrt_llm: Path, tiny_llama_dir: Path) -> None:
    """Prefill on one instance, decode on another: the KV moves by the engines' own transfer
    (here the stand-in's files), once, and the tokens are those of a whole request."""
    prompt = [5, 77, 300, 1024, 9, 18, 600, 42, 7, 1999, 3]

    async def body() -> None:
        async with (
            open_backend(TENSORRT_LLM, tiny_llama_dir) as prefill,
            open_backend(TENSORRT_LLM, tiny_llama_dir) as decode,
        ):
            whole = [
                t
                async for o in decode.generate(EngineRequest("w", prompt, GREEDY))
                for t in o.new_token_ids
            ]
            pre = await prefill.prefill(EngineRequest("r", prompt, GREEDY), handoff=Handoff.NATIVE)
            assert pre.native is not None and list(fake_tensorrt_llm.iterdir())
            first = (pre.output.new_token_ids[0], pre.output.new_logprobs[0])
            stream = decode.decode(
                EngineRequest("r", prompt, GREEDY, reservation_id="t"), first, pre.native
            )
            async with aclosing(stream):
                rest = [t async for o in stream for t in o.new_token_ids]
            assert [first[0], *rest] == whole
            assert not list(fake_tensorrt_llm.iterdir())  # read once, then gone
            # The same handle again: its KV is gone, and the transfer fails clearly.
            again = decode.decode(EngineRequest("r2", prompt, GREEDY), first, pre.native)
            with pytest.raises(KVTransferError, match="timed out"):
                async with aclosing(again):
                    async for _ in again:
                        pass

    run(body)


def test_handle_of_another_backend_is_refused(
    fake_tensorrt_llm: Path, tiny_llama_dir: Path
) -> None:
    async def body() -> None:
        async with open_backend(TENSORRT_LLM, tiny_llama_dir) as backend:
            other = NativeKV(backend="elsewhere", ctx_request_id=1, first_gen_tokens=(5,))
            stream = backend.decode(EngineRequest("x", [5, 6, 7], GREEDY), (5, 0.0), other)
            with pytest.raises(InvalidArgumentError) as err:
                async with aclosing(stream):
                    async for _ in stream:
                        pass
            assert err.value.field == "kv.native.backend"

    run(body)


def test_shape_errors_name_the_key(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4}')
    with pytest.raises(ModelLoadError, match="vocab_size"):
        read_shape(tmp_path)
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_shape(tmp_path / "nowhere")
