"""Logprobs over gRPC through real clusters, against HF transformers (float32, 1e-4).

Disaggregated: the prefill worker computes the prompt's logprobs and the first token's
alternatives (``PrefillResponse``), the decode worker the rest (``DecodeChunk``); colocated:
the mixed worker all of them. Either way the SDK's ``Completion`` and the deltas of a stream
carry, for every output token, the ``logprobs=k`` most likely tokens of HF's distribution at
that position, and ``prompt_logprobs`` are HF's for every prompt token with their ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.client import Client, Completion, InvalidRequest
from pdserve.launcher import Cluster
from pdserve.logprobs import PromptLogprobs
from tests.unit.engine.hf_reference import HFReference

pytestmark = pytest.mark.integration

WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256")
PROMPT = "the quick brown fox jumps over the lazy dog and the cat"
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> HFReference:
    return HFReference(tiny_llama_dir)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def client(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[Client]:
    with (
        Cluster(tiny_llama_dir, mode=request.param, worker_args=WORKER_ARGS) as cluster,
        Client(cluster.router_address, timeout=60) as c,
    ):
        yield c


def check(done: Completion, hf: HFReference, k: int, prompt_k: int) -> None:
    prompt = done.prompt_logprobs
    assert isinstance(prompt, PromptLogprobs)
    ids = prompt.token_ids + done.token_ids
    reference = torch.log_softmax(hf.logits(ids), dim=-1)
    n = len(prompt.token_ids)
    # every prompt token after the first, given the ones before it
    chosen = reference[: n - 1].gather(1, torch.tensor(ids[1:n]).unsqueeze(1)).squeeze(1)
    assert prompt.logprobs == pytest.approx(chosen.tolist(), abs=ATOL)
    assert prompt.ranks == ((reference[: n - 1] > chosen.unsqueeze(1)).sum(1) + 1).tolist()
    assert len(prompt.top) == n - 1
    for i, top in enumerate(prompt.top):
        values, tokens = torch.topk(reference[i], prompt_k)
        assert list(top.token_ids) == tokens.tolist()
        assert list(top.logprobs) == pytest.approx(values.tolist(), abs=ATOL)
    # every output token: its own logprob and the k most likely at its position
    assert len(done.top_logprobs) == len(done.token_ids)
    for j, (token, top) in enumerate(zip(done.token_ids, done.top_logprobs, strict=True)):
        row = reference[n - 1 + j]
        values, tokens = torch.topk(row, k)
        assert list(top.token_ids) == tokens.tolist()
        assert list(top.logprobs) == pytest.approx(values.tolist(), abs=ATOL)
        assert done.logprobs[j] == pytest.approx(float(row[token]), abs=ATOL)


def test_logprobs_match_hf_whole_and_streamed(client: Client, hf: HFReference) -> None:
    asked = {"max_tokens": 6, "temperature": 0.7, "seed": 5, "ignore_eos": True}
    done = client.generate(PROMPT, logprobs=4, prompt_logprobs=2, **asked)  # type: ignore[arg-type]
    check(done, hf, 4, 2)
    deltas = list(client.stream(PROMPT, logprobs=4, prompt_logprobs=2, **asked))  # type: ignore[arg-type]
    assert deltas[0].prompt_logprobs == done.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert [t for d in deltas for t in d.top_logprobs] == done.top_logprobs
    plain = client.generate(PROMPT, **asked)  # type: ignore[arg-type]
    assert plain.token_ids == done.token_ids
    assert plain.top_logprobs == [] and plain.prompt_logprobs is None


@pytest.mark.parametrize(("name", "value"), [("logprobs", 21), ("prompt_logprobs", 21)])
def test_more_than_20_is_refused_by_name(client: Client, name: str, value: int) -> None:
    with pytest.raises(InvalidRequest) as err:
        client.generate(PROMPT, max_tokens=2, **{name: value})  # type: ignore[arg-type]
    assert err.value.field == f"sampling.{name}"
