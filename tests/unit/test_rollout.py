"""The rollout split: arms by share and tenant, its JSON form, and the command-line parsing."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.router.rollout import Rollout, bucket, parse_shares


def test_shares_split_request_ids_stably() -> None:
    rollout = Rollout({"disaggregated": 10.0, "conditional": 30.0}, rest="colocated")
    ids = [f"req-{i}" for i in range(20000)]
    arms = Counter(rollout.arm(i) for i in ids)
    assert arms["disaggregated"] / len(ids) == pytest.approx(0.10, abs=0.01)
    assert arms["conditional"] / len(ids) == pytest.approx(0.30, abs=0.01)
    assert arms["colocated"] / len(ids) == pytest.approx(0.60, abs=0.01)
    assert [rollout.arm(i) for i in ids[:50]] == [rollout.arm(i) for i in ids[:50]]
    assert all(0 <= bucket(i) < 100 for i in ids[:100])


def test_growing_a_share_only_moves_requests_into_that_arm() -> None:
    small = Rollout({"disaggregated": 10.0})
    large = Rollout({"disaggregated": 50.0})
    ids = [f"r{i}" for i in range(5000)]
    assert all(large.arm(i) == "disaggregated" for i in ids if small.arm(i) == "disaggregated")


def test_tenants_are_pinned_and_the_extremes_hold() -> None:
    rollout = Rollout({"disaggregated": 100.0}, tenants={"acme": "colocated"})
    assert rollout.arm("x", "acme") == "colocated"
    assert rollout.arm("x", "other") == "disaggregated"
    rolled_back = Rollout({"disaggregated": 0.0})
    assert {rolled_back.arm(f"r{i}") for i in range(1000)} == {"colocated"}


def test_json_round_trip_and_description() -> None:
    rollout = Rollout({"disaggregated": 10.0}, "conditional", {"acme": "colocated"}, version=4)
    assert Rollout.from_json(rollout.to_json()) == rollout
    assert (
        "disaggregated=10%" in rollout.describe() and "rest (90%) conditional" in rollout.describe()
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"shares": {"fast": 10.0}}, "shares"),
        ({"shares": {"colocated": -1.0}}, "shares"),
        ({"shares": {"colocated": 60.0, "disaggregated": 50.0}}, "shares"),
        ({"rest": "nowhere"}, "rest"),
        ({"tenants": {"acme": "fast"}}, "tenants.acme"),
    ],
)
def test_bad_splits_name_their_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        Rollout(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_parse_shares() -> None:
    assert parse_shares(["disaggregated=10%", "conditional=2.5"]) == {
        "disaggregated": 10.0,
        "conditional": 2.5,
    }
    for bad in (["disaggregated"], ["disaggregated=lots"], ["warp=5%"]):
        with pytest.raises(InvalidArgumentError):
            parse_shares(bad)
    with pytest.raises(InvalidArgumentError):
        Rollout.from_json(b"[1]")
