"""merge_ready: outputs already waiting for a consumer are taken as one, in order."""

from __future__ import annotations

import asyncio

import torch

from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine_loop.coalesce import merge_ready
from pdserve.errors import WorkerUnavailableError


def _out(tokens: list[int], *, text: str = "", finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(
        "r",
        list(tokens),
        [-float(t) for t in tokens],
        text=text,
        finished=finish is not None,
        finish_reason=finish,
    )


def _queue(*items: RequestOutput | BaseException) -> asyncio.Queue[RequestOutput | BaseException]:
    q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_waiting_outputs_are_merged_in_order_up_to_the_finish() -> None:
    first = _out([1], text="a")
    q = _queue(_out([2, 3], text="b"), _out([4], text="c", finish=FinishReason.LENGTH))
    merged = merge_ready(first, q)
    assert not isinstance(merged, BaseException)
    assert merged.new_token_ids == [1, 2, 3, 4]
    assert merged.new_logprobs == [-1.0, -2.0, -3.0, -4.0]
    assert merged.text == "abc"
    assert merged.finished and merged.finish_reason is FinishReason.LENGTH
    assert q.empty()
    assert first.new_token_ids == [1] and first.text == "a"  # the engine's object is untouched


def test_an_output_that_is_alone_is_passed_as_it_is() -> None:
    first = _out([1])
    assert merge_ready(first, _queue()) is first


def test_nothing_is_merged_after_a_finish() -> None:
    first = _out([1], finish=FinishReason.STOP)
    later = _out([2])
    q = _queue(later)
    assert merge_ready(first, q) is first
    assert q.get_nowait() is later


def test_an_error_behind_outputs_stays_next_in_line() -> None:
    err = WorkerUnavailableError("the engine shut down")
    q = _queue(_out([2]), err, _out([9]))
    merged = merge_ready(_out([1]), q)
    assert not isinstance(merged, BaseException) and merged.new_token_ids == [1, 2]
    assert q.get_nowait() is err
    nxt = q.get_nowait()
    assert not isinstance(nxt, BaseException) and nxt.new_token_ids == [9]


def test_outputs_with_logits_are_never_merged() -> None:
    with_logits = _out([2])
    with_logits.logits = torch.zeros(4)
    q = _queue(with_logits)
    first = _out([1])
    assert merge_ready(first, q) is first
    assert q.get_nowait() is with_logits
