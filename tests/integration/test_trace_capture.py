"""``pdserve trace capture`` against a small cluster of simulated workers (``--backend sim``:
real Redis, scheduler and router; workers that model an H100 and compute nothing).

The command runs in-process on a thread while requests go through the router; the trace it
writes has one line per request with the right counts, prompts that share a prefix share
their leading block hashes (the scheduler's own hashes), and ``load_trace`` reads it.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from pdserve.client import Client
from pdserve.launcher import Cluster
from pdserve.models.demo import init_checkpoint
from pdserve.router.capture import FIELD_HELLO
from pdserve.router.capture_cli import main_capture
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.prefix_index import PromptBlocks
from pdserve.trace_file import load_trace

pytestmark = pytest.mark.integration

PROFILE = "roofline:h100:llama-3-8b"
SHARED = [(7 * i) % 1900 + 20 for i in range(100)]
"""A long prefix (six full blocks of 16) two prompts share."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served vocabulary and tokenizer (the sim reads no weights)."""
    return init_checkpoint(tmp_path_factory.mktemp("capture_model"), "tiny", dtype="float32")


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    with Cluster(
        model_dir, backend="sim", mode="conditional", num_prefill=1, num_decode=1,
        worker_args=("--sim-profile", PROFILE), log_level="WARNING",
    ) as c:  # fmt: skip
        yield c


def _until_router_captures(redis_url: str, namespace: str, timeout_s: float = 60) -> None:
    """Wait for a router's hello in the record stream: from then on it admits requests."""
    client = sync_redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            entries: Any = client.xrange(KeySpace(namespace).capture_stream)
            if any(FIELD_HELLO.encode() in fields for _, fields in entries):
                return
            if time.monotonic() > deadline:
                raise AssertionError("no router started capturing")
            time.sleep(0.05)  # polling Redis: nothing to wait on
    finally:
        client.close()


def test_a_capture_records_each_request_and_replays(cluster: Cluster, tmp_path: Path) -> None:
    assert cluster.redis_url is not None
    out = tmp_path / "trace.jsonl"
    # (prompt, max_tokens, tenant): distinct prompt lengths, two prompts sharing SHARED.
    requests: list[tuple[list[int], int, str]] = [
        ([30 + i for i in range(5 + 9 * n)], 3 + n, "alpha") for n in range(7)
    ]
    requests.insert(2, ([*SHARED, 11, 12, 13], 4, "alpha"))
    requests.insert(5, ([*SHARED, 14, 15, 16, 17, 18], 6, "alpha"))
    requests.append(([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], 5, "beta"))
    argv = [
        "--redis-url", cluster.redis_url, "--namespace", cluster.namespace,
        "--duration", "300", "--out", str(out), "--max-records", str(len(requests)),
        "--drain-s", "0",
    ]  # fmt: skip
    status: list[int] = []
    command = threading.Thread(target=lambda: status.append(main_capture(argv)), daemon=True)
    command.start()
    _until_router_captures(cluster.redis_url, cluster.namespace)

    client = Client(cluster.router_address, timeout=60)
    try:
        for prompt, max_tokens, tenant in requests:
            done = client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, tenant=tenant)
            assert len(done.token_ids) == max_tokens
    finally:
        client.close()
    command.join(timeout=120)
    assert not command.is_alive() and status == [0]

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(requests)
    by_length = {r["prompt_tokens"]: r for r in lines}
    assert len(by_length) == len(requests)
    for prompt, max_tokens, tenant in requests:
        record = by_length[len(prompt)]
        assert (record["output_tokens"], record["max_tokens"]) == (max_tokens, max_tokens)
        assert (record["tenant"], record["finish_reason"]) == (tenant, "length")
        assert record["block_hashes"] == [
            h.hex() for h in PromptBlocks(prompt, tenant).hashes(record["block_size"])
        ]
        assert not any(isinstance(v, list) and v and isinstance(v[0], int) for v in record.values())
    first, second = by_length[len(SHARED) + 3], by_length[len(SHARED) + 5]
    shared_blocks = len(SHARED) // 16
    assert len(first["block_hashes"]) >= shared_blocks
    assert first["block_hashes"][:shared_blocks] == second["block_hashes"][:shared_blocks]
    unrelated = by_length[5 + 9 * 6]["block_hashes"]
    assert unrelated and not set(first["block_hashes"]) & set(unrelated)
    # Sent one after the other: the trace keeps their order, from 0.
    assert [r["prompt_tokens"] for r in lines] == [len(p) for p, _, _ in requests]
    assert lines[0]["arrival_s"] == 0.0
    assert all(a["arrival_s"] <= b["arrival_s"] for a, b in itertools.pairwise(lines))

    entries = load_trace(out)
    assert [(e.prompt_tokens, e.output_tokens) for e in entries] == [
        (len(p), m) for p, m, _ in requests
    ]
    # The setting is gone: the routers stopped capturing.
    check = sync_redis.Redis.from_url(cluster.redis_url)
    try:
        assert check.get(KeySpace(cluster.namespace).capture) is None
    finally:
        check.close()
