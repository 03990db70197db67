"""``pdserve up``'s flags for the HTTP gateway and the lines it prints about it."""

from __future__ import annotations

from pathlib import Path

from pdserve.up import DEFAULT_HTTP_PORT, _http_lines, up_parser


def test_http_flags() -> None:
    default = up_parser().parse_args([])
    assert default.http_port == DEFAULT_HTTP_PORT == 8000 and not default.no_http
    chosen = up_parser().parse_args(["--http-port", "0", "--no-http"])
    assert chosen.http_port == 0 and chosen.no_http


def test_http_lines_name_the_url_and_a_request() -> None:
    text = _http_lines("http://127.0.0.1:8123", "demo-small")
    assert "OpenAI-compatible HTTP API at http://127.0.0.1:8123/v1 " in text
    assert "curl http://127.0.0.1:8123/v1/completions" in text
    assert '"model": "demo-small"' in text


def test_secured_http_lines_trust_the_ca_and_send_the_key() -> None:
    text = _http_lines("https://127.0.0.1:8123", "demo-small", Path("/tls/ca.pem"), api_key=True)
    assert "OpenAI-compatible HTTP API at https://127.0.0.1:8123/v1 " in text
    assert "curl https://127.0.0.1:8123/v1/completions --cacert /tls/ca.pem " in text
    assert '-H "Authorization: Bearer $PDSERVE_API_KEY"' in text
    no_keys = _http_lines("https://127.0.0.1:8123", "demo-small", Path("/tls/ca.pem"))
    assert "--cacert /tls/ca.pem" in no_keys and "Authorization" not in no_keys


def test_gateway_args_repeat() -> None:
    assert up_parser().parse_args([]).gateway_arg == []
    args = up_parser().parse_args(
        ["--gateway-arg=--allow-unknown-fields", "--gateway-arg=--parse-threads=4"]
    )
    assert args.gateway_arg == ["--allow-unknown-fields", "--parse-threads=4"]
