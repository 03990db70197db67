"""Typed errors of the client SDK, one class per gRPC status a caller handles differently.

The names read as what happened (``except Overloaded:``); ``PdServeClientError`` is the base.
"""

from __future__ import annotations

import re

import grpc

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")
# gRPC's words for a request message over a size limit: the server's receive limit (older
# versions say it without the "SERVER: " prefix), or this client's own send limit. A response
# over the client's receive limit ("CLIENT: Received ...") is not the request's fault.
_TOO_LARGE = re.compile(
    r"^(?P<who>SERVER: |CLIENT: )?(?P<how>Received|Sent) message larger than max "
    r"\((?P<size>\d+) vs\. (?P<limit>\d+)\)"
)


class PdServeClientError(Exception):
    """A request failed; ``code`` is the gRPC status code and ``message`` its details."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequest(PdServeClientError):  # noqa: N818 - the SDK's public names
    """The request is malformed (INVALID_ARGUMENT); ``field`` names the offending field."""

    @property
    def field(self) -> str | None:
        """The field named at the start of the message (``sampling.max_tokens``), if any."""
        match = _FIELD.match(self.message)
        return match.group(1) if match else None


class RequestTooLarge(InvalidRequest):
    """The request message is larger than the router receives at all (or than this client
    sends), so gRPC refused it unparsed, and always will: shorten the prompt. gRPC's status is
    RESOURCE_EXHAUSTED (its words end the message), but the request is what is wrong, so
    ``code`` is INVALID_ARGUMENT and ``field`` is ``prompt``; never ``Overloaded``, which a
    caller would retry. A prompt over the router's limits by less is refused by the router's
    check, as ``InvalidRequest`` naming ``text`` or ``token_ids`` and the limit."""


class Overloaded(PdServeClientError):  # noqa: N818 - the SDK's public names
    """No worker has room right now (RESOURCE_EXHAUSTED); retry later or with less work."""


class DeadlineExceeded(PdServeClientError):  # noqa: N818 - the SDK's public names
    """The request's timeout passed (DEADLINE_EXCEEDED)."""


class Unavailable(PdServeClientError):  # noqa: N818 - the SDK's public names
    """The router or a worker cannot be reached (UNAVAILABLE)."""


class Cancelled(PdServeClientError):  # noqa: N818 - the SDK's public names
    """The call was cancelled (CANCELLED)."""


class NotFound(PdServeClientError):  # noqa: N818 - the SDK's public names
    """Something the request refers to does not exist (NOT_FOUND)."""


class Unauthenticated(PdServeClientError):  # noqa: N818 - the SDK's public names
    """No valid API key (or certificate) was presented (UNAUTHENTICATED)."""


class PermissionDenied(PdServeClientError):  # noqa: N818 - the SDK's public names
    """The credential is valid but not for this (PERMISSION_DENIED)."""


class ServerError(PdServeClientError):
    """The server failed (INTERNAL, UNKNOWN, FAILED_PRECONDITION, ...)."""


_BY_CODE: dict[grpc.StatusCode, type[PdServeClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def _request_too_large(message: str) -> RequestTooLarge | None:
    """The error for gRPC's refusal of a request message over a size limit, if it is one."""
    match = _TOO_LARGE.match(message)
    if match is None:
        return None
    if match["how"] == "Sent":
        who = "this client sends"
    elif match["who"] != "CLIENT: ":
        who = "the router takes"
    else:
        return None
    size, limit = match["size"], match["limit"]
    return RequestTooLarge(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"prompt: the request is {size} bytes; {who} {limit} at most ({message})",
    )


def error_from_code(code: grpc.StatusCode, message: str) -> PdServeClientError:
    """The typed error for a status code (and, for RESOURCE_EXHAUSTED, its message)."""
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and (too_large := _request_too_large(message)):
        return too_large
    return _BY_CODE.get(code, ServerError)(code, message)


def error_from_rpc(err: grpc.RpcError) -> PdServeClientError:
    """The typed error for a failed call (sync or asyncio)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return error_from_code(code, details or "")
