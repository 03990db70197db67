"""Errors of calls the router makes to other services, turned into precise caller errors.

A failed downstream call must reach the client with the same status code (a worker that is
gone is UNAVAILABLE, a full cluster is RESOURCE_EXHAUSTED) but with a message that says which
step and which worker failed, so that the caller does not see an anonymous INTERNAL.

A worker that refuses one of the request's sampling parameters (a structured-output guide
that does not compile: only the worker's grammar library can tell) names it by the path the
caller sent it under (``sampling.guided_regex``, the same in the worker's request and the
router's): that refusal reaches the caller as its own INVALID_ARGUMENT naming that field.
"""

from __future__ import annotations

import re
from typing import Any

import grpc
from grpc.aio import AioRpcError

from pdserve.errors import HandedBackError, InvalidArgumentError, PdServeError
from pdserve.v1 import common_pb2, prefill_pb2


class DeadlineExceededError(PdServeError):
    """The caller's deadline passed before the request finished."""

    grpc_code = "DEADLINE_EXCEEDED"


class DownstreamError(PdServeError):
    """A call to the scheduler, a worker or the KV store failed; keeps that call's status code."""

    def __init__(
        self, step: str, code: grpc.StatusCode, details: str, *, handed_back: bool = False
    ) -> None:
        super().__init__(f"{step} failed ({code.name}): {details}")
        self.step = step
        self.code = code
        self.details = details
        self.handed_back = handed_back
        """The worker handed the request back (``HandedBackError``): it left the phase."""
        # Instance attribute: the rpc error mapping reads grpc_code to pick the status.
        self.grpc_code = code.name


_SAMPLING_FIELD = re.compile(r"^(sampling\.[a-z_]+): (.*)$", re.DOTALL)


def downstream_error(step: str, err: AioRpcError) -> PdServeError:
    """The caller-facing error for ``err``, raised by the call named ``step``."""
    code = err.code()
    details = err.details() or "no details"
    refused = _SAMPLING_FIELD.match(details) if code is grpc.StatusCode.INVALID_ARGUMENT else None
    if refused is not None:
        return InvalidArgumentError(refused.group(1), f"{refused.group(2)} (refused by {step})")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"deadline exceeded during {step}: {details}")
    if code is grpc.StatusCode.UNAVAILABLE:
        return DownstreamError(
            step, code, f"{details}; the request may be retried",
            handed_back=details.startswith(HandedBackError.MARK),
        )  # fmt: skip
    if code is grpc.StatusCode.CANCELLED:
        # The router cancels downstream calls only on its own way out; a CANCELLED seen here
        # means the other side gave up (a worker shutting down): retryable, like UNAVAILABLE.
        return DownstreamError(step, grpc.StatusCode.UNAVAILABLE, f"cancelled by peer: {details}")
    return DownstreamError(step, code, details)


async def unary_call(step: str, call: Any) -> Any:
    """Await a unary call, turning its failure into a caller-facing error naming ``step``."""
    try:
        return await call
    except AioRpcError as err:
        raise downstream_error(step, err) from err


async def late_kv(call: Any) -> common_pb2.KVHandle | None:
    """The KV handle of a Prefill call that completed although nobody read its answer."""
    if not call.done() or call.cancelled():
        return None
    try:
        resp: prefill_pb2.PrefillResponse = await call  # done: returns at once
    except AioRpcError:
        return None  # it failed: nothing was stored
    return resp.kv if resp.HasField("kv") else None
