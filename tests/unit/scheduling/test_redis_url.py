"""Redis URLs: Sentinel targets parsed from the URL, malformed ones refused naming the flag,
and passwords kept out of logs."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.redis_url import (
    SENTINEL_PORT,
    check_redis_url,
    is_sentinel,
    parse_sentinel,
    redacted,
)


def test_a_sentinel_url_names_its_sentinels_master_and_credentials() -> None:
    url = "redis+sentinel://app:s3cret@10.0.0.1:26380,sentinel-b,[::1]:5000/pdserve/3?sentinel_password=sp"
    t = parse_sentinel(url)
    assert t.sentinels == (("10.0.0.1", 26380), ("sentinel-b", SENTINEL_PORT), ("::1", 5000))
    assert (t.service, t.db, t.username, t.password) == ("pdserve", 3, "app", "s3cret")
    assert (t.sentinel_username, t.sentinel_password, t.tls) == (None, "sp", False)


def test_defaults_and_tls() -> None:
    t = parse_sentinel("rediss+sentinel://s1/mymaster?ssl_ca_certs=/ca.pem")
    assert (t.db, t.username, t.password, t.tls) == (0, None, None, True)
    assert t.tls_options == {"ssl_ca_certs": "/ca.pem"}
    assert is_sentinel("redis+sentinel://s1/m") and not is_sentinel("redis://h:6379/0")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel:///pdserve", "at least one sentinel"),
        ("redis+sentinel://s1:99999/pdserve", "port must be 1-65535"),
        ("redis+sentinel://s1:x/pdserve", "port must be 1-65535"),
        ("redis+sentinel://s1", "/SERVICE or /SERVICE/DB"),
        ("redis+sentinel://s1/a/b/c", "/SERVICE or /SERVICE/DB"),
        ("redis+sentinel://s1/pdserve/zero", "'zero' is not a number"),
        ("redis+sentinel://s1/pdserve?socket_timeout=1", "unknown option(s) socket_timeout"),
        ("redis+sentinel://s1/pdserve?ssl_ca_certs=/ca", "need the rediss+sentinel://"),
        ("http://h:6379/0", "unsupported scheme 'http'"),
    ],
)
def test_a_malformed_url_is_refused_naming_the_flag(url: str, says: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        check_redis_url(url, "--redis-url")
    assert err.value.field == "--redis-url"
    assert says in str(err.value)


@pytest.mark.parametrize(
    "url", ["redis://h:6379/0", "rediss://:pw@h:6380/1", "unix:///run/redis.sock"]
)
def test_plain_urls_pass(url: str) -> None:
    check_redis_url(url)


def test_passwords_stay_out_of_logs() -> None:
    assert redacted("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted("redis://u:pw@h:6379/0") == "redis://u:***@h:6379/0"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"
    hidden = redacted("redis+sentinel://:pw@s1:1,s2:2/m/0?sentinel_password=sp&ssl_ca_certs=/ca")
    assert "pw" not in hidden and "sp" not in hidden.replace("ssl", "")
    assert hidden.startswith("redis+sentinel://:***@s1:1,s2:2/m/0?sentinel_password=***")
