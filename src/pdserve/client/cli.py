"""``pdserve generate``: stream a completion from a router to the terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.client.client import Client
from pdserve.client.errors import PdServeClientError
from pdserve.client.request import DEFAULT_TIMEOUT_S, RequestOptions
from pdserve.client.results import Completion
from pdserve.errors import InvalidArgumentError
from pdserve.security.tls import TlsConfig


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve generate", description="stream a completion")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--router", default=os.environ.get("PDSERVE_ROUTER", "127.0.0.1:50051"),
                   help="router host:port (default: $PDSERVE_ROUTER, else port 50051)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (server default 1)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string, repeatable")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"deadline, seconds (default {DEFAULT_TIMEOUT_S:g}; 0: none)")  # fmt: skip
    p.add_argument("--tenant", default=None)
    p.add_argument("--stats", action="store_true", help="print usage and timing at the end")
    c = p.add_argument_group("sampling controls (docs/sampling.md)")
    for name in ("min-p", "presence-penalty", "frequency-penalty", "repetition-penalty"):
        c.add_argument(f"--{name}", type=float, default=None)
    c.add_argument("--min-tokens", type=int, default=None)
    g = p.add_argument_group(
        "structured output (one at most; @FILE reads the value from a file)"
    ).add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="JSON|@FILE", help="the answer follows this schema")
    g.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    g.add_argument("--regex", metavar="RE|@FILE", help="the answer matches this regex")
    g.add_argument("--choice", action="append", help="the answer is one of these, repeatable")
    g.add_argument("--grammar", metavar="EBNF|@FILE", help="the answer follows this grammar")
    s = p.add_argument_group("a secured router (docs/security.md)")
    s.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None,
                   help="API key (default: $PDSERVE_API_KEY)")  # fmt: skip
    s.add_argument("--tls", action="store_true", help="TLS, checked against the system's CAs")
    s.add_argument("--tls-ca", type=Path, help="TLS, checked against this CA bundle (PEM)")
    s.add_argument("--tls-cert", type=Path, help="client certificate (PEM), for mutual TLS")
    s.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    return p


def _tls_of(args: argparse.Namespace) -> TlsConfig | bool:
    if args.tls_ca is None and args.tls_cert is None:
        return bool(args.tls)
    return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def _value(text: str | None) -> str | None:
    """A flag's value, or with ``@PATH`` the text of that file."""
    if text is None or not text.startswith("@"):
        return text
    return Path(text[1:]).read_text(encoding="utf-8")


def request_options(args: argparse.Namespace) -> RequestOptions:
    """The SDK's request keywords the flags give (only those set)."""
    options = RequestOptions(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens"):  # fmt: skip
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    schema, regex, grammar = _value(args.json_schema), _value(args.regex), _value(args.grammar)
    if schema is not None:
        try:
            options["guided_json"] = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError("--json-schema", f"is not JSON: {e}") from None
    if args.json_object:
        options["guided_json_object"] = True
    if regex is not None:
        options["guided_regex"] = regex
    if args.choice:
        options["guided_choice"] = list(args.choice)
    if grammar is not None:
        options["guided_grammar"] = grammar
    return options


def main_generate(argv: Sequence[str]) -> int:
    """Entry of ``pdserve generate``; returns the exit status."""
    args = generate_parser().parse_args(list(argv))
    client = Client(
        args.router, timeout=args.timeout if args.timeout > 0 else None, tenant=args.tenant,
        api_key=args.api_key, tls=_tls_of(args),
    )  # fmt: skip
    try:
        options = request_options(args)
    except OSError as e:
        print(f"pdserve generate: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except InvalidArgumentError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    with client:
        try:
            with client.stream(args.prompt, **options) as stream:
                for delta in stream:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                result = stream.completion()
        except PdServeClientError as e:
            print(f"\npdserve generate: {e}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if args.stats:
        print("\n".join(stats_lines(result)))
    return 0


def stats_lines(result: Completion) -> list[str]:
    """``--stats``: the request's outcome, tokens and where its time went, as a small table."""
    u, t = result.usage, result.timing
    if u is None or t is None:  # a router that sent no final accounting
        return [f"finish  {result.finish_reason}", f"tokens  {len(result.token_ids)} generated"]
    moved = f"{t.transfer_bytes / 1e6:.2f} MB by {t.transport}" if t.transport else "-"
    rows = [
        ("finish", str(result.finish_reason)),
        ("tokens", f"{u.prompt_tokens} prompt ({u.cached_tokens} cached), "
                   f"{u.completion_tokens} generated"),
        ("time to first token", f"{t.ttft_ms:.1f} ms"),
        ("end to end", f"{t.e2e_ms:.1f} ms"),
        ("  queue", f"{t.queue_ms:.1f} ms"),
        ("  prefill", f"{t.prefill_ms:.1f} ms"),
        ("  KV transfer", f"{t.transfer_ms:.1f} ms ({moved})"),
        ("  decode", f"{t.decode_ms:.1f} ms"),
    ]  # fmt: skip
    if u.completion_tokens > 1 and t.decode_ms > 0:
        per = t.decode_ms / (u.completion_tokens - 1)
        rows.append(("  per output token", f"{per:.1f} ms after the first"))
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]
