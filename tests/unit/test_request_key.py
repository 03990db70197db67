"""``RequestKey``: a request id scoped by its tenant, encoded so that no two keys share one
``scoped_id`` whatever separators the tenant and the id hold."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.keys import handoff_key
from pdserve.request_key import RequestKey
from pdserve.transfer.janitor import segment_name

TRICKY = ("", "a", ":", "@", "#", "0", "1", "/", "|")
"""Characters of ids and tenants that a naive join would confuse: separators and digits."""


def test_keys_that_a_plain_join_confuses_stay_apart() -> None:
    pairs = [
        (RequestKey("a:b", "c"), RequestKey("a", "b:c")),
        (RequestKey("acme", "x"), RequestKey("", "x@acme#4")),
        (RequestKey("a#1", "x"), RequestKey("1", "x@a")),
        (RequestKey("", "x"), RequestKey("0", "x")),
        (RequestKey("ab", "x"), RequestKey("b", "x@a")),
    ]
    for one, other in pairs:
        assert one.scoped_id != other.scoped_id, (one, other)
        assert RequestKey.parse(one.scoped_id) == one
        assert RequestKey.parse(other.scoped_id) == other


def test_every_short_key_over_tricky_characters_has_its_own_scoped_id() -> None:
    words = ["".join(p) for n in range(4) for p in itertools.product(TRICKY[1:], repeat=n)]
    seen: dict[str, RequestKey] = {}
    for tenant, request_id in itertools.product(words, words[1:]):
        key = RequestKey(tenant, request_id)
        assert seen.setdefault(key.scoped_id, key) == key, (key, seen[key.scoped_id])
        assert RequestKey.parse(key.scoped_id) == key
    assert len(seen) == len(words) * (len(words) - 1)


@given(st.text(), st.text(min_size=1))
def test_parse_inverts_scoped_id(tenant: str, request_id: str) -> None:
    key = RequestKey(tenant, request_id)
    assert RequestKey.parse(key.scoped_id) == key


@given(st.text(), st.text(min_size=1), st.text(), st.text(min_size=1))
def test_different_keys_never_share_a_scoped_id(t1: str, r1: str, t2: str, r2: str) -> None:
    assert (RequestKey(t1, r1).scoped_id == RequestKey(t2, r2).scoped_id) == ((t1, r1) == (t2, r2))


def test_the_callers_id_leads_so_prefixes_still_match() -> None:
    # Worker faults (--fault nan@PREFIX) and log searches match request ids by prefix.
    assert RequestKey("acme", "nan-7").scoped_id.startswith("nan-")
    assert RequestKey("acme", "nan-7").scoped_id == "nan-7@acme#4"
    assert RequestKey("", "r").scoped_id == "r@#0"


@pytest.mark.parametrize(
    "text",
    ["", "r", "r#", "r@#", "@#0", "r@acme#5", "r@acme#04", "r@acme#+4", "r@acme# 4",
     "racme#4", "r@acme#٤", "r@a#" + "9" * 5000],
)  # fmt: skip
def test_strings_no_key_encodes_to_parse_to_none(text: str) -> None:
    assert RequestKey.parse(text) is None


def test_an_empty_request_id_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="request_id"):
        RequestKey("acme", "")


def test_downstream_names_made_of_the_scoped_id_differ_per_tenant() -> None:
    # What the workers derive from the id they get: hand-off keys and shm segment names.
    a, b = RequestKey("acme", "x").scoped_id, RequestKey("globex", "x").scoped_id
    cap = bytes(16)
    assert handoff_key(a, cap) != handoff_key(b, cap)
    assert segment_name(a, owner_pid=1) != segment_name(b, owner_pid=1)
