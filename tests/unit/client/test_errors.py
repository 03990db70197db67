"""The SDK's typed errors: a request message gRPC refuses for its size is ``RequestTooLarge``
(an ``InvalidRequest`` naming the prompt), never ``Overloaded``: retrying cannot help."""

from __future__ import annotations

import grpc
import pytest

from pdserve.client import InvalidRequest, Overloaded, RequestTooLarge
from pdserve.client.errors import error_from_code

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("details", "who"),
    [
        ("SERVER: Received message larger than max (300010 vs. 27648)", "the router takes"),
        ("Received message larger than max (300010 vs. 27648)", "the router takes"),  # older
        ("CLIENT: Sent message larger than max (300010 vs. 27648)", "this client sends"),
    ],
)
def test_a_message_over_a_size_limit_is_request_too_large(details: str, who: str) -> None:
    err = error_from_code(EXHAUSTED, details)
    assert isinstance(err, RequestTooLarge) and isinstance(err, InvalidRequest)
    assert not isinstance(err, Overloaded)
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT and err.field == "prompt"
    assert err.message == f"prompt: the request is 300010 bytes; {who} 27648 at most ({details})"


@pytest.mark.parametrize(
    "details",
    [
        "no decode worker has room for 4096 tokens",
        "CLIENT: Received message larger than max (9 vs. 8)",  # a response: not the request's
    ],
)
def test_other_resource_exhausted_is_overloaded(details: str) -> None:
    err = error_from_code(EXHAUSTED, details)
    assert type(err) is Overloaded and err.message == details
