"""``pdserve trace capture``: record the traffic the routers serve, as a trace to replay.

    pdserve trace capture --redis-url redis://HOST:6379/0 --duration 3600 --out day.jsonl
    pdserve trace capture --redis-url ... --duration 600 --sample 0.1 --out sample.jsonl
    pdserve bench serve --trace day.jsonl ...        # the same arrivals against any target

It switches capture on for every router of the cluster (the setting in Redis, with a TTL,
``router.capture``), reads their records as they come for ``--duration`` seconds, switches
capture off, waits up to ``--drain-s`` for the requests still running, and writes one JSON
line per request, sorted by arrival, with ``arrival_s`` counted from the first one::

    {"arrival_s": 0.0, "prompt_tokens": 812, "output_tokens": 97, "max_tokens": 256,
     "tenant": "acme", "finish_reason": "stop", "block_size": 16, "block_hashes": [...]}

``trace_file.load_trace`` reads it, and a replay gives records that share leading
block hashes the same leading prompt tokens (``bench.serve.prefixes``), so prefix reuse and
KV-aware placement see the captured sharing. Ctrl-C stops early and writes
what came so far. One capture at a time per namespace: a second is refused while one runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.errors import InvalidArgumentError, PdServeError, WorkerUnavailableError
from pdserve.router.capture import (
    FIELD_CAPTURE,
    FIELD_HELLO,
    FIELD_RECORD,
    POLL_S,
    CaptureSetting,
)
from pdserve.scheduling.keys import KeySpace, text
from pdserve.scheduling.redis_url import redacted
from pdserve.scheduling.registry import connect

logger = logging.getLogger(__name__)

TTL_MARGIN_S = 30.0
"""The setting outlives the capture by this much: a command that dies leaves it to expire."""
QUIET_WARNING_S = 5 * POLL_S
"""No router said hello this long after the start: say so (wrong Redis or namespace?)."""

Announce = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class CaptureOptions:
    """What to capture; each bad value is an ``InvalidArgumentError`` naming its flag."""

    redis_url: str
    out: Path
    duration_s: float
    namespace: str = "pdserve"
    sample: float = 1.0
    block_size: int = 16
    drain_s: float = 30.0
    max_records: int | None = None

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise InvalidArgumentError("--redis-url", "required (or set $PDSERVE_REDIS_URL)")
        if not math.isfinite(self.duration_s) or self.duration_s <= 0:
            raise InvalidArgumentError("--duration", f"must be > 0 seconds, got {self.duration_s}")
        if not 0.0 < self.sample <= 1.0:
            raise InvalidArgumentError("--sample", f"must be in (0, 1], got {self.sample}")
        if self.block_size < 1:
            raise InvalidArgumentError("--block-size", f"must be >= 1, got {self.block_size}")
        if not math.isfinite(self.drain_s) or self.drain_s < 0:
            raise InvalidArgumentError("--drain-s", f"must be >= 0 seconds, got {self.drain_s}")
        if self.max_records is not None and self.max_records < 1:
            raise InvalidArgumentError("--max-records", f"must be >= 1, got {self.max_records}")
        KeySpace(self.namespace)  # validates it
        _check_writable(self.out)


def _check_writable(path: Path) -> None:
    """Refuse an output path that could not be written, before capturing anything."""
    if path.is_dir():
        raise InvalidArgumentError("--out", f"{path} is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise InvalidArgumentError("--out", f"no such directory: {parent}")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise InvalidArgumentError("--out", f"{path} is not writable")


@dataclass(slots=True)
class Captured:
    """What a capture collected."""

    records: list[dict[str, Any]] = field(default_factory=list)
    routers: set[str] = field(default_factory=set)
    """The routers that said hello."""
    entry_ids: list[bytes | str] = field(default_factory=list)
    unreadable: int = 0
    interrupted: bool = False


def trace_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """The records as trace lines: sorted by arrival, ``arrival_s`` from the first."""
    ordered = sorted(records, key=lambda r: float(r["arrival_unix_s"]))
    if not ordered:
        return []
    start = float(ordered[0]["arrival_unix_s"])
    lines = []
    for record in ordered:
        rest = {k: v for k, v in record.items() if k != "arrival_unix_s"}
        arrival = round(float(record["arrival_unix_s"]) - start, 6)
        lines.append(json.dumps({"arrival_s": arrival, **rest}))
    return lines


def _take(captured: Captured, setting: CaptureSetting, fields: dict[Any, Any]) -> None:
    """One stream entry: a record or a router's hello of this capture; others ignored."""
    values = {text(k): v for k, v in fields.items()}
    if text(values.get(FIELD_CAPTURE, b"")) != setting.id:
        return
    if FIELD_HELLO in values:
        captured.routers.add(text(values[FIELD_HELLO]))
        return
    try:
        record = json.loads(values[FIELD_RECORD])
        float(record["arrival_unix_s"])
    except (KeyError, TypeError, ValueError):
        captured.unreadable += 1
        return
    captured.records.append(record)


async def _clear(redis: Redis, keys: KeySpace, setting: CaptureSetting) -> None:
    """Switch capture off, unless the key now holds another capture's setting."""
    raw = await redis.get(keys.capture)
    if raw is not None and text(raw) == setting.to_json():
        await redis.delete(keys.capture)


async def _read(
    redis: Redis,
    keys: KeySpace,
    setting: CaptureSetting,
    cursor: bytes | str,
    opts: CaptureOptions,
    announce: Announce,
) -> Captured:
    """Collect the capture's entries from ``cursor`` on until the duration, then the drain,
    is over (or ``max_records`` came, or Ctrl-C); switches capture off after the duration."""
    captured = Captured()
    started = time.monotonic()
    end, drain_end = started + opts.duration_s, None
    failing = warned = False
    try:
        while opts.max_records is None or len(captured.records) < opts.max_records:
            now = time.monotonic()
            if drain_end is None and now >= end:
                await _clear(redis, keys, setting)
                drain_end = now + opts.drain_s
                announce(f"duration over: waiting up to {opts.drain_s:g}s for running requests")
            if drain_end is not None and now >= drain_end:
                break
            if not warned and not captured.routers and now - started >= QUIET_WARNING_S:
                warned = True
                announce("no router has answered yet (do they use this Redis and namespace?)")
            left = (drain_end if drain_end is not None else end) - now
            try:
                replies: Any = await redis.xread(
                    {keys.capture_stream: cursor}, block=max(1, int(min(left, 1.0) * 1000)),
                    count=512,
                )  # fmt: skip
            except (RedisError, OSError) as err:
                if not failing:
                    announce(f"reading the records failed, retrying: {err}")
                failing = True
                await asyncio.sleep(min(left, POLL_S))  # a retry timer
                continue
            failing = False
            for _, entries in replies or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    hello = len(captured.routers)
                    before = len(captured.records)
                    _take(captured, setting, fields)
                    if len(captured.records) > before:
                        captured.entry_ids.append(entry_id)
                    if len(captured.routers) > hello:
                        announce(f"capturing at {len(captured.routers)} router(s)")
    except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels the main task): keep what came
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        captured.interrupted = True
    return captured


async def collect(opts: CaptureOptions, announce: Announce = _stderr) -> Captured:
    """Run one capture (see the module docstring) and return what it collected."""
    redis = connect(opts.redis_url)
    keys = KeySpace(opts.namespace)
    setting = CaptureSetting(
        uuid.uuid4().hex, time.time() + opts.duration_s, opts.sample, opts.block_size
    )
    try:
        # Where "now" is in the stream, taken before any router can see the setting.
        last: Any = await redis.xrevrange(keys.capture_stream, count=1)
        cursor: bytes | str = last[0][0] if last else "0-0"
        ttl = math.ceil(opts.duration_s + opts.drain_s + TTL_MARGIN_S)
        if not await redis.set(keys.capture, setting.to_json(), ex=ttl, nx=True):
            running = await redis.get(keys.capture)
            raise PdServeError(
                f"a capture is already running in namespace {opts.namespace!r} "
                f"({text(running) if running is not None else 'just ended'}); wait for it"
            )
        announce(
            f"capturing {opts.sample:.0%} of requests for {opts.duration_s:g}s "
            f"(namespace {opts.namespace})"
        )
        try:
            captured = await _read(redis, keys, setting, cursor, opts, announce)
        finally:
            await _clear(redis, keys, setting)
        if captured.entry_ids:  # the records are in the file now; best effort
            for i in range(0, len(captured.entry_ids), 1000):
                await redis.xdel(keys.capture_stream, *captured.entry_ids[i : i + 1000])
        return captured
    finally:
        await redis.aclose()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve trace capture",
        description="record the routers' traffic (shape only, never prompt text) as a trace "
        "for 'pdserve bench serve --trace'",
    )
    p.add_argument(
        "--redis-url", default=os.environ.get("PDSERVE_REDIS_URL"),
        help="the cluster's Redis (default: $PDSERVE_REDIS_URL)",
    )  # fmt: skip
    p.add_argument("--namespace", default="pdserve", help="Redis key prefix of the cluster")
    p.add_argument("--duration", type=float, required=True, help="seconds of arrivals to record")
    p.add_argument("--out", type=Path, required=True, help="the JSON-lines trace to write")
    p.add_argument("--sample", type=float, default=1.0, help="share of requests, in (0, 1]")
    p.add_argument(
        "--block-size", type=int, default=16,
        help="tokens per prefix block hash (the workers' KV block size)",
    )  # fmt: skip
    p.add_argument(
        "--drain-s", type=float, default=30.0,
        help="after the duration, how long to wait for requests still running",
    )  # fmt: skip
    p.add_argument("--max-records", type=int, default=None, help="stop after this many")
    return p


def main_capture(argv: Sequence[str]) -> int:
    """Entry of ``pdserve trace capture``."""
    args = _parser().parse_args(list(argv))
    opts = CaptureOptions(
        redis_url=args.redis_url or "", out=args.out, duration_s=args.duration,
        namespace=args.namespace, sample=args.sample, block_size=args.block_size,
        drain_s=args.drain_s, max_records=args.max_records,
    )  # fmt: skip
    try:
        captured = asyncio.run(collect(opts))
    except (OSError, RedisError) as e:
        raise WorkerUnavailableError(f"cannot reach {redacted(opts.redis_url)}: {e}") from e
    lines = trace_lines(captured.records)
    try:
        opts.out.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    except OSError as e:
        raise InvalidArgumentError("--out", f"cannot write {opts.out}: {e}") from e
    notes = [f"from {len(captured.routers)} router(s)"]
    if captured.unreadable:
        notes.append(f"{captured.unreadable} unreadable entries skipped")
    if captured.interrupted:
        notes.append("interrupted")
    print(f"wrote {len(lines)} records to {opts.out} ({', '.join(notes)})")
    return 0
