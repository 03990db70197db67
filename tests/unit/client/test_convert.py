"""The Router's answers from the router's side to the SDK's (``adapters.router`` then
``client.convert``): every field arrives, and an unfinished chunk stays unfinished."""

from __future__ import annotations

from pdserve.adapters import router
from pdserve.client import convert as client
from pdserve.client.results import Completion, Delta, Usage
from pdserve.engine.outputs import FinishReason
from pdserve.router.output import RouteChunk, RouteUsage
from pdserve.timing import Timing

TIMING = Timing(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7, "shm")


def last_chunk() -> RouteChunk:
    return RouteChunk(
        "r-1",
        token_ids=[5, 6],
        logprobs=[-0.5, -0.25],
        text="ab",
        finish_reason=FinishReason.LENGTH,
        usage=RouteUsage(10, 2, 8),
        timing=TIMING,
    )


def test_a_streamed_chunk_round_trips() -> None:
    delta = client.delta_from_proto(router.generate_chunk(last_chunk(), first=True))
    assert delta == Delta("ab", [5, 6], [-0.5, -0.25], "length", Usage(10, 2, 8), TIMING, "r-1")
    assert delta.finished
    # Later chunks carry no request id; a running one no finish, usage or timing.
    running = client.delta_from_proto(router.generate_chunk(RouteChunk("r-1", [7]), first=False))
    assert running == Delta("", [7], [], None, None, None, "")
    assert not running.finished


def test_a_whole_response_round_trips() -> None:
    completion = client.completion_from_proto(router.generate_response(last_chunk()))
    assert completion == Completion(
        "ab", [5, 6], [-0.5, -0.25], "length", Usage(10, 2, 8), TIMING, "r-1"
    )
