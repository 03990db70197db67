"""What the router does when a worker fails a request: retry it elsewhere, or migrate it.

* **Before any token went out** (a Prefill call, or a colocated stream that sent nothing,
  failed with UNAVAILABLE: the worker died, was unreachable or shut down): the request is
  placed again, excluding every worker that failed it, and starts over there. At most
  ``FlowConfig.prefill_attempts`` tries in all.
* **Mid-stream** (a Decode or colocated stream broke after tokens went out): the request
  migrates. A new decode worker is reserved (``Assign(decode_only, exclude)``) and sent the
  prompt plus every token streamed so far with a ``recompute`` KV handle
  (``DecodeRequest.resumed_token_ids``); it prefills them and continues at the next output
  position, so the caller's stream goes on with no token lost or repeated. At most
  ``FlowConfig.migration_limit`` migrations per request.

Only UNAVAILABLE is retried (CANCELLED by the peer arrives as UNAVAILABLE, see
``downstream``): a refused request (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) would fail the
same way elsewhere, and a deadline is the caller's. The reservation of the failed attempt is
released before the new one is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pdserve.convert import sampling_to_proto
from pdserve.errors import InvalidArgumentError, PdServeError
from pdserve.router.downstream import DownstreamError
from pdserve.router.request import RouteRequest
from pdserve.v1 import common_pb2, decode_pb2

HANDBACK_LIMIT = 8
"""Hand-backs at most of one request. A worker hands its streams back when it leaves their
phase (a planner's move), which is no failure and does not use up ``prefill_attempts`` or
``migration_limit``: a planner moving several decode workers in a row may move one stream
more than twice. One handed back this often bounces between workers that keep moving."""


def retryable(err: PdServeError) -> bool:
    """True when ``err`` says the worker went away, not that the request was wrong."""
    return isinstance(err, DownstreamError) and err.code is grpc.StatusCode.UNAVAILABLE


@dataclass(slots=True)
class Attempts:
    """One request's tries and migrations so far, against their bounds."""

    prefill_attempts: int
    """Tries in all while no token went out (>= 1)."""
    migration_limit: int
    """Migrations at most once tokens went out (>= 0)."""
    tries: int = 1
    migrations: int = 0
    handbacks: int = 0

    def __post_init__(self) -> None:
        if self.prefill_attempts < 1:
            raise InvalidArgumentError(
                "prefill_attempts", f"must be >= 1, got {self.prefill_attempts}"
            )
        if self.migration_limit < 0:
            raise InvalidArgumentError(
                "migration_limit", f"must be >= 0, got {self.migration_limit}"
            )

    def another(self, err: PdServeError, *, migrating: bool) -> bool:
        """Whether to go on after ``err`` (counting that go): a retry from the start, or a
        migration when tokens went out already."""
        if not retryable(err):
            return False
        if isinstance(err, DownstreamError) and err.handed_back:
            self.handbacks += 1
            return self.handbacks <= HANDBACK_LIMIT
        if migrating:
            self.migrations += 1
            return self.migrations <= self.migration_limit
        self.tries += 1
        return self.tries <= self.prefill_attempts


def migrated_request(
    req: RouteRequest,
    streamed: list[int],
    *,
    reservation_id: str,
    fingerprint: str,
    reason: str,
) -> decode_pb2.DecodeRequest:
    """The Decode call that continues ``req`` after the ``streamed`` tokens (at least one).

    ``fingerprint``: the model that drew them (the prefill's KV handle), "" when unknown.
    """
    handle = common_pb2.KVHandle(
        request_id=req.key.scoped_id,
        num_tokens=len(req.prompt_token_ids),
        model_fingerprint=fingerprint,
        recompute=common_pb2.RecomputeLocation(reason=reason),
    )
    return decode_pb2.DecodeRequest(
        request_id=req.key.scoped_id,
        prompt_token_ids=req.prompt_token_ids,
        first_token_id=streamed[0],
        # Kept only by the worker's engine, never streamed again: the caller has it already.
        first_logprob=0.0,
        resumed_token_ids=streamed[1:],
        sampling=sampling_to_proto(req.params),
        kv=handle,
        reservation_id=reservation_id,
        tenant=req.tenant,
    )
