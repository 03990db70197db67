"""OpenAI's error shape and the HTTP status of each way a request fails.

Every error the gateway answers is ``{"error": {"message", "type", "param", "code"}}``.
The router's gRPC status decides the HTTP status (UNAUTHENTICATED: 401 ``invalid_api_key``,
PERMISSION_DENIED: 403); an INVALID_ARGUMENT names the router's field
(``sampling.max_tokens``, ``text``), which ``openai_param`` turns back into the parameter the
caller sent (``max_tokens``, ``prompt`` or ``messages``). RESOURCE_EXHAUSTED is a 429 (no room
now: retry later), except gRPC's own "message larger than max", which says that the request is
too large for the router ever to take: a 400 on the prompt, as retrying cannot help.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from pdserve.client import InvalidRequest, PdServeClientError, RequestTooLarge
from pdserve.gateway.responses import ErrorDetail, ErrorResponse


@dataclass(frozen=True, slots=True)
class Status:
    """HTTP status code and OpenAI error type."""

    http: int
    type: str


BAD_REQUEST = Status(400, "invalid_request_error")
UNAUTHORIZED = Status(401, "invalid_request_error")
"""No API key, or one the router refuses (OpenAI answers a bad key so, code
``invalid_api_key``)."""
FORBIDDEN = Status(403, "permission_error")
NOT_FOUND = Status(404, "not_found_error")
CONFLICT = Status(409, "invalid_request_error")
"""A ``request_id`` that a request of the same caller still runs under."""
TOO_LARGE = Status(413, "invalid_request_error")
"""A body over ``--max-body-bytes``."""
OVERLOADED = Status(429, "rate_limit_error")
SERVER_ERROR = Status(500, "server_error")
UNAVAILABLE = Status(503, "service_unavailable_error")
TIMEOUT = Status(504, "timeout_error")

_BY_GRPC_CODE: dict[grpc.StatusCode, Status] = {
    grpc.StatusCode.INVALID_ARGUMENT: BAD_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: BAD_REQUEST,
    grpc.StatusCode.UNAUTHENTICATED: UNAUTHORIZED,
    grpc.StatusCode.PERMISSION_DENIED: FORBIDDEN,
    grpc.StatusCode.NOT_FOUND: NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OVERLOADED,
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: TIMEOUT,
}

_PROMPT_FIELDS = ("text", "token_ids", "prompt")
_TOO_LARGE_FOR_GRPC = re.compile(r"message larger than max \((\d+) vs\. (\d+)\)")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""``code`` of a 400 for a prompt longer than the model or the router takes (OpenAI's)."""


class GatewayError(Exception):
    """A request the gateway answers with an OpenAI error body."""

    def __init__(
        self,
        status: Status,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.close = close
        """Close the connection after the answer: the rest of the body is not to be read."""

    def body(self) -> ErrorResponse:
        detail = ErrorDetail(
            message=self.message, type=self.status.type, param=self.param, code=self.code
        )
        return ErrorResponse(error=detail)


INVALID_API_KEY = "invalid_api_key"
NO_KEY_MESSAGE = (
    "You didn't provide an API key: send it in the Authorization header "
    "('Authorization: Bearer KEY')."
)
BAD_KEY_MESSAGE = "Incorrect API key provided."


def unauthorized(api_key_sent: bool) -> GatewayError:
    """The 401 of a request without a key, or with one the router refused (the key itself is
    never echoed)."""
    message = BAD_KEY_MESSAGE if api_key_sent else NO_KEY_MESSAGE
    return GatewayError(UNAUTHORIZED, message, code=INVALID_API_KEY)


def bad_request(param: str | None, message: str, code: str = "invalid_value") -> GatewayError:
    """A 400 naming ``param``; the message starts with it, as the router's messages do."""
    text = f"{param}: {message}" if param else message
    return GatewayError(BAD_REQUEST, text, param=param, code=code)


def openai_param(
    field: str | None, *, prompt_param: str, max_tokens_param: str, guide_param: str | None = None
) -> str | None:
    """The request parameter a router field name stands for.

    ``sampling.max_tokens`` -> ``max_tokens_param``, ``sampling.top_p`` -> ``top_p``;
    ``text``/``token_ids``/``prompt`` (and ``token_ids[3]``) -> ``prompt_param``;
    ``sampling.guided_json`` (any guide) -> ``guide_param`` when the gateway made the guide
    (from ``tools``), else ``guided_json``.
    """
    if field is None:
        return None
    name = field.removeprefix("sampling.")
    if name == "max_tokens":
        return max_tokens_param
    if guide_param is not None and name.startswith("guided_"):
        return guide_param
    if any(name == f or name.startswith(f"{f}[") for f in _PROMPT_FIELDS):
        return prompt_param
    return name


def from_client_error(
    err: PdServeClientError,
    *,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
    api_key_sent: bool = True,
    guide_param: str | None = None,
) -> GatewayError:
    """The HTTP error for a failed router call; ``api_key_sent`` tells an UNAUTHENTICATED
    call that carried no key from one whose key was refused."""
    if err.code == grpc.StatusCode.UNAUTHENTICATED:
        return unauthorized(api_key_sent)
    if isinstance(err, RequestTooLarge):  # the SDK's reading of gRPC's "larger than max"
        return bad_request(
            prompt_param or None, err.message.removeprefix("prompt: "), code=CONTEXT_LENGTH_EXCEEDED
        )
    too_large = _TOO_LARGE_FOR_GRPC.search(err.message)
    if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and too_large is not None:
        size, limit = too_large.groups()
        return bad_request(
            prompt_param or None,
            f"the request is {size} bytes on the wire; the router takes {limit} at most: "
            "shorten the prompt",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    status = _BY_GRPC_CODE.get(err.code, SERVER_ERROR)
    code = err.code.name.lower()
    if err.code == grpc.StatusCode.ALREADY_EXISTS:  # the one id a caller chooses
        message = f"request_id: {err.message.removeprefix('request_id ')}"
        return GatewayError(CONFLICT, message, param="request_id", code=code)
    if isinstance(err, InvalidRequest):
        param = openai_param(
            err.field, prompt_param=prompt_param, max_tokens_param=max_tokens_param,
            guide_param=guide_param,
        )  # fmt: skip
        message = err.message
        if err.field is not None and param is not None and param != err.field:
            message = f"{param}: {message.removeprefix(f'{err.field}: ')}"
        return GatewayError(status, message, param=param, code=code)
    return GatewayError(status, err.message or code, code=code)
