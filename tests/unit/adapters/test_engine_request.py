"""The worker services' request messages -> ``EngineRequest`` (``adapters.worker``): every
field carried under its own name, the call's deadline on the monotonic clock."""

from __future__ import annotations

import time

import pytest

from pdserve.adapters.worker import engine_request
from pdserve.convert import sampling_from_proto
from pdserve.errors import InvalidArgumentError
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2


def test_each_worker_message_gives_the_same_request() -> None:
    sampling = common_pb2.SamplingParams(max_tokens=7, temperature=0.5)
    fields = dict(
        request_id="r@t#1", prompt_token_ids=[5, 6, 7], sampling=sampling, tenant="t",
        reservation_id="resv-1",
    )  # fmt: skip
    messages = (
        prefill_pb2.PrefillRequest(**fields, decode_address="d:1", transport="shm"),
        decode_pb2.DecodeRequest(**fields, first_token_id=9),
        decode_pb2.ColocatedRequest(**fields),
    )
    requests = [engine_request(m, None) for m in messages]
    first = requests[0]
    assert all(r == first for r in requests)
    assert (first.request_id, first.prompt_ids, first.tenant, first.reservation_id) == (
        "r@t#1", (5, 6, 7), "t", "resv-1"
    )  # fmt: skip
    assert first.params == sampling_from_proto(sampling)
    assert first.deadline is None


def test_the_calls_deadline_is_on_the_monotonic_clock() -> None:
    before = time.monotonic()
    request = engine_request(prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1]), 30.0)
    assert request.deadline is not None
    assert before + 30.0 <= request.deadline <= time.monotonic() + 30.0


def test_bad_sampling_is_refused_by_field() -> None:
    bad = common_pb2.SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidArgumentError) as err:
        engine_request(decode_pb2.ColocatedRequest(request_id="r", sampling=bad), None)
    assert err.value.field == "sampling.temperature"
