"""The host-side checks of ``deploy/compose-smoke`` (run with this checkout on PYTHONPATH).

    python deploy/compose_smoke_check.py demo-key CERTS_INIT_LOG        # prints the key
    python deploy/compose_smoke_check.py wait-http URL CA TIMEOUT_S
    python deploy/compose_smoke_check.py refused ROUTER_ADDR HTTPS_URL CA
    python deploy/compose_smoke_check.py requests ROUTER_ADDR HTTPS_URL CA KEY_FILE
    python deploy/compose_smoke_check.py prometheus PROM_URL DECODE_REPLICAS TIMEOUT_S
    python deploy/compose_smoke_check.py jaeger JAEGER_URL TIMEOUT_S
    python deploy/compose_smoke_check.py wait-workers ROLE COUNT TIMEOUT_S -- STATUS_COMMAND...

Each exits 0 when its check holds, else 1 with what it saw. The waits poll: the containers
offer nothing to block on. The stack is the secured one: gRPC over TLS with an API key,
HTTPS checked against the cluster's CA (copied out of the secrets volume).
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.client import Client, PdServeClientError, TlsConfig

JOBS = ("router", "gateway", "scheduler", "kvstore", "prefill", "decode", "planner")
PROMPT = "Once upon a time"
KEY_LINE = "PDSERVE_API_KEY="


def _context(ca: str | None) -> ssl.SSLContext | None:
    return ssl.create_default_context(cafile=ca) if ca else None


def _get(url: str, ca: str | None = None, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=10, context=_context(ca)) as reply:
        return json.loads(reply.read())


def _post(url: str, body: dict[str, Any], ca: str | None = None, key: str | None = None) -> bytes:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120, context=_context(ca)) as reply:
        return bytes(reply.read())


def _poll(what: str, timeout_s: float, check: Callable[[], str | None]) -> None:
    """Until ``check`` returns None (done); it returns what it saw otherwise."""
    deadline = time.monotonic() + timeout_s
    seen: str | None = "nothing yet"
    while time.monotonic() < deadline:
        try:
            seen = check()
        except (OSError, urllib.error.URLError, ValueError, KeyError) as err:
            seen = f"{type(err).__name__}: {err}"
        if seen is None:
            print(f"compose-smoke: {what}: ok", file=sys.stderr)
            return
        time.sleep(2.0)
    raise SystemExit(f"compose-smoke: timed out waiting for {what}; last seen: {seen}")


def demo_key(log: str) -> None:
    """Print the demo key certs-init printed, checking it printed exactly one."""
    keys = [line.split(KEY_LINE, 1)[1].strip() for line in Path(log).read_text().splitlines()
            if KEY_LINE in line]  # fmt: skip
    if len(keys) != 1:
        raise SystemExit(f"compose-smoke: certs-init printed {len(keys)} demo keys, not one")
    print(keys[0])
    print("compose-smoke: certs-init printed the demo API key once", file=sys.stderr)


def wait_http(url: str, ca: str, timeout_s: str) -> None:
    _poll(f"{url} to answer 200", float(timeout_s), lambda: None if _get(url, ca) else "empty")


def refused(router: str, http: str, ca: str) -> None:
    """Plaintext gRPC, gRPC without a key and HTTPS without a key are all refused."""
    for tls, what in ((False, "plaintext gRPC"), (TlsConfig(ca=Path(ca)), "gRPC without a key")):
        try:
            with Client(router, timeout=10, tls=tls) as client:
                client.generate(PROMPT, max_tokens=1)
        except PdServeClientError as err:
            print(f"compose-smoke: {what} refused ({type(err).__name__}): ok", file=sys.stderr)
            continue
        raise SystemExit(f"compose-smoke: the router answered {what}")
    try:
        _get(f"{http}/v1/models", ca)
    except urllib.error.HTTPError as err:
        if err.code != 401:
            raise SystemExit(f"compose-smoke: HTTPS without a key: {err.code}, not 401") from err
        print("compose-smoke: HTTPS without a key refused (401): ok", file=sys.stderr)
        return
    raise SystemExit("compose-smoke: the gateway answered without a key")


def requests(router: str, http: str, ca: str, key_file: str) -> None:
    """A greedy completion over gRPC (TLS, the key) and over HTTPS give the same tokens; chat
    and a stream answer too."""
    key = Path(key_file).read_text().strip()
    with Client(router, timeout=120, api_key=key, tls=TlsConfig(ca=Path(ca))) as client:
        expected = client.generate(PROMPT, max_tokens=12, temperature=0)
    (model,) = _get(f"{http}/v1/models", ca, key)["data"]
    body = {"model": model["id"], "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    answer = json.loads(_post(f"{http}/v1/completions", body, ca, key))
    choice = answer["choices"][0]
    if choice["token_ids"] != expected.token_ids or choice["text"] != expected.text:
        raise SystemExit(f"compose-smoke: HTTP gave {choice}, gRPC {expected}")
    hello = {"model": model["id"], "messages": [{"role": "user", "content": "Hi"}],
             "max_tokens": 8}  # fmt: skip
    chat = json.loads(_post(f"{http}/v1/chat/completions", hello, ca, key))
    if chat["usage"]["completion_tokens"] < 1 or chat["choices"][0]["message"]["role"] != (
        "assistant"
    ):
        raise SystemExit(f"compose-smoke: bad chat answer {chat}")
    stream = _post(f"{http}/v1/completions", {**body, "stream": True}, ca, key).decode()
    events = [line for line in stream.splitlines() if line.startswith("data: ")]
    if events[-1] != "data: [DONE]" or len(events) < 3:
        raise SystemExit(f"compose-smoke: bad stream {events}")
    print(
        f"compose-smoke: gRPC and HTTP agree on {len(expected.token_ids)} tokens "
        f"({expected.text!r}); chat and stream answered",
        file=sys.stderr,
    )


def jaeger(url: str, timeout_s: str) -> None:
    """Jaeger holds a trace of the router with its spans (the latency breakdown of one
    request: /trace/ID in the UI)."""

    def check() -> str | None:
        traces = _get(f"{url}/api/traces?service=pdserve-router&limit=5")["data"]
        spans = max((len(t["spans"]) for t in traces), default=0)
        if spans < 2:
            return f"{len(traces)} router traces, at most {spans} spans"
        print(f"compose-smoke: Jaeger trace {traces[0]['traceID']} ({spans} spans)",
              file=sys.stderr)  # fmt: skip
        return None

    _poll(f"a router trace in Jaeger at {url}", float(timeout_s), check)


def prometheus(url: str, decode_replicas: str, timeout_s: str) -> None:
    """Every service's /metrics scraped (``decode_replicas`` decode targets), the rules
    loaded and evaluated without error, and request metrics stored."""
    want = int(decode_replicas)

    def check() -> str | None:
        targets = _get(f"{url}/api/v1/targets")["data"]["activeTargets"]
        up: dict[str, int] = {}
        for t in targets:
            if t["health"] == "up":
                job = t["labels"]["job"].removeprefix("pdserve-")
                up[job] = up.get(job, 0) + 1
        if any(up.get(job, 0) < 1 for job in JOBS) or up.get("decode") != want:
            return f"targets up: {up}"
        groups = _get(f"{url}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        bad = [r["name"] for r in rules if r.get("health") != "ok"]
        if not rules or bad:
            return f"{len(rules)} rules, not evaluated or failing: {bad}"
        query = urllib.parse.quote("sum(pdserve_requests_total)")
        result = _get(f"{url}/api/v1/query?query={query}")["data"]["result"]
        if not result or float(result[0]["value"][1]) < 1:
            return f"no requests counted yet: {result}"
        return None

    _poll(f"Prometheus scraping all jobs ({want} decode) with {url}", float(timeout_s), check)


def wait_workers(role: str, count: str, timeout_s: str, *command: str) -> None:
    """``command`` (``pdserve status``) lists ``count`` live workers of ``role``."""

    def check() -> str | None:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
        rows = [line.split() for line in out.splitlines()[1:]]
        live = [r for r in rows if len(r) > 1 and r[1] == role and "draining" not in r]
        return None if len(live) == int(count) else out

    _poll(f"{count} live {role} workers", float(timeout_s), check)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    name, args = argv[0], argv[1:]
    if name == "wait-workers":
        split = args.index("--")
        wait_workers(*args[:split], *args[split + 1 :])
        return
    commands: dict[str, Callable[..., None]] = {
        "demo-key": demo_key,
        "wait-http": wait_http,
        "refused": refused,
        "requests": requests,
        "prometheus": prometheus,
        "jaeger": jaeger,
    }
    commands[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
