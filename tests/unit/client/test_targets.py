"""The SDK's channel target: one router as given, several as one balanced channel."""

from __future__ import annotations

import pytest

from pdserve.client.client import channel_target
from pdserve.errors import InvalidArgumentError

BALANCED = [("grpc.lb_policy_name", "round_robin")]


def test_one_router_is_used_as_given() -> None:
    assert channel_target("router.internal:50051") == ("router.internal:50051", [])


def test_several_routers_become_one_balanced_channel() -> None:
    assert channel_target("10.0.0.1:50051, 10.0.0.2:50052") == (
        "ipv4:10.0.0.1:50051,10.0.0.2:50052", BALANCED)  # fmt: skip
    assert channel_target("[::1]:1,[::2]:2") == ("ipv6:[::1]:1,[::2]:2", BALANCED)
    assert channel_target("dns:///routers.internal:50051") == (
        "dns:///routers.internal:50051", BALANCED)  # fmt: skip


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("a.internal:1,b.internal:2", "IP:PORT entries"),
        ("10.0.0.1:1,[::1]:2", "all IPv4 or all IPv6"),
    ],
)
def test_a_list_that_cannot_be_one_channel_is_refused(address: str, says: str) -> None:
    with pytest.raises(InvalidArgumentError, match=says):
        channel_target(address)
