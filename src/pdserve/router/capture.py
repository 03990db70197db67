"""Traffic capture: the shape of the requests a router serves, recorded for a later replay.

An operator asks "what P:D ratio and how many workers would have held my SLO yesterday":
``pdserve trace capture`` (``capture_cli``) switches capture on for every router of a
cluster, collects one record per request, and writes a trace that ``pdserve bench serve
--trace`` replays against any target. A record holds the request's shape and nothing of its
content::

    {"arrival_unix_s": 1718000000.123456, "prompt_tokens": 812, "output_tokens": 97,
     "max_tokens": 256, "tenant": "acme", "finish_reason": "stop", "block_size": 16,
     "block_hashes": ["5f0c...", ...]}

``block_hashes`` are the prompt's chained block hashes as the scheduler's KV index sees them
(``scheduling.prefix_index.PromptBlocks``: ``chain_block_hashes`` salted with the tenant, the
last token left out), hex: two records share leading hashes exactly when their prompts share
that many leading blocks, which is what KV-aware placement and prefix caching depend on.
Neither the prompt's text nor its token ids are recorded, nor the request id (a caller may
put anything in it). ``output_tokens`` are the tokens streamed to the caller, at least one
(a request that failed before its first token counts one; its ``finish_reason`` says
``error`` or ``cancelled``).

Switching it on: the setting lives in Redis (``{ns}:capture``, JSON with a TTL, see
``CaptureSetting``), so that one command reaches every router without restarting any, as
with the rollout split (``router.rollout``). ``Capture`` polls it every ``poll_s``; a request
is admitted (sampled) when it enters the flow while capture is on, and recorded when it
ends, however it ends. Records go to a capped stream, ``{ns}:capture:records`` (field ``r``,
with the capture's id in ``c``); on first seeing a capture each router adds a ``hello`` entry
naming itself, so the command can tell how many routers capture.

Capture never costs a request more than a check when off, and never fails one: the record is
queued (bounded; past the bound it is dropped and counted) and built and written by a
background task, where hashing a long prompt cannot stall the request's stream. A Redis
error while capturing is logged once per outage and the records are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.errors import InvalidArgumentError
from pdserve.router.request import RouteRequest
from pdserve.router.state import RequestState
from pdserve.router.telemetry import ObservedRequest
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.prefix_index import PromptBlocks
from pdserve.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""How often a router reads the capture setting."""
STREAM_MAX_LEN = 10_000
"""Entries the record stream keeps at least (trimmed approximately): the reader takes them
as they come, so this only has to cover its lag."""
STREAM_TTL_S = 3600
"""The record stream expires this long after its last write (a capture nobody reads)."""
MAX_PENDING = 10_000
"""Finished requests waiting for the writer at most; past it, records are dropped."""
WRITE_BATCH = 256

FIELD_CAPTURE, FIELD_RECORD, FIELD_HELLO = "c", "r", "hello"
"""Fields of a stream entry: the capture's id, a record (JSON), a router's name."""
ENDED_ERROR, ENDED_CANCELLED = "error", "cancelled"
"""``finish_reason`` of a request that ended without finishing."""


@dataclass(frozen=True, slots=True)
class CaptureSetting:
    """A capture, as stored in ``{ns}:capture``::

    {"id": "4be1...", "until": 1718003600.0, "sample": 1.0, "block_size": 16}
    """

    id: str
    """Names the capture: its records carry it, so a reader takes only its own."""
    until: float
    """Unix time after which no request is admitted any more."""
    sample: float = 1.0
    """Share of the requests recorded, in (0, 1]."""
    block_size: int = 16
    """Tokens per block of ``block_hashes`` (the workers' KV block size)."""

    def __post_init__(self) -> None:
        if not self.id:
            raise InvalidArgumentError("id", "must not be empty")
        if not math.isfinite(self.until):
            raise InvalidArgumentError("until", f"must be a finite time, got {self.until}")
        if not 0.0 < self.sample <= 1.0:
            raise InvalidArgumentError("sample", f"must be in (0, 1], got {self.sample}")
        if self.block_size < 1:
            raise InvalidArgumentError("block_size", f"must be >= 1, got {self.block_size}")

    def to_json(self) -> str:
        return json.dumps(
            {"id": self.id, "until": self.until, "sample": self.sample,
             "block_size": self.block_size},
            sort_keys=True,
        )  # fmt: skip

    @classmethod
    def from_json(cls, raw: str | bytes) -> CaptureSetting:
        try:
            data: Any = json.loads(raw)
            fields = (
                str(data["id"]), float(data["until"]), float(data.get("sample", 1.0)),
                int(data.get("block_size", 16)),
            )  # fmt: skip
        except (ValueError, TypeError, KeyError) as err:  # JSON and field errors alike
            raise InvalidArgumentError("capture", f"unreadable setting: {err!r}") from None
        return cls(*fields)


def capture_record(
    request: RouteRequest,
    *,
    arrival_unix_s: float,
    output_tokens: int,
    finish_reason: str,
    block_size: int,
) -> dict[str, Any]:
    """The record of one request (see the module docstring): its shape, never its content."""
    hashes = PromptBlocks(request.prompt_token_ids, request.tenant).hashes(block_size)
    return {
        "arrival_unix_s": round(arrival_unix_s, 6),
        "prompt_tokens": len(request.prompt_token_ids),
        "output_tokens": max(1, output_tokens),
        "max_tokens": request.params.max_tokens,
        "tenant": request.tenant,
        "finish_reason": finish_reason,
        "block_size": block_size,
        "block_hashes": [h.hex() for h in hashes],
    }


@dataclass(frozen=True, slots=True)
class _Finished:
    """A request that ended, waiting for the writer to turn it into a record."""

    capture_id: str
    block_size: int
    request: RouteRequest
    arrival_unix_s: float
    output_tokens: int
    finish_reason: str

    def entry(self) -> dict[str, str]:
        record = capture_record(
            self.request,
            arrival_unix_s=self.arrival_unix_s,
            output_tokens=self.output_tokens,
            finish_reason=self.finish_reason,
            block_size=self.block_size,
        )
        return {FIELD_CAPTURE: self.capture_id, FIELD_RECORD: json.dumps(record)}


def _entries(batch: list[_Finished]) -> list[dict[str, str]]:
    return [finished.entry() for finished in batch]


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: recorded under its capture when it ends (``finished``)."""

    capture: Capture
    setting: CaptureSetting
    arrival_unix_s: float

    def finished(self, run: RequestState, failed: type[BaseException] | None) -> None:
        """The request ended: with its last chunk, or by ``failed`` (an exception class)."""
        if run.finish_reason is not None:
            reason = str(run.finish_reason)
        elif failed is not None and issubclass(failed, (asyncio.CancelledError, GeneratorExit)):
            reason = ENDED_CANCELLED
        else:
            reason = ENDED_ERROR
        self.capture.queue(
            _Finished(
                self.setting.id, self.setting.block_size, run.request, self.arrival_unix_s,
                run.completion_tokens, reason,
            )
        )  # fmt: skip


def router_name() -> str:
    """How a router names itself in a ``hello`` entry."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Capture:
    """A router's side of traffic capture (see the module docstring); run it with
    ``capturing``."""

    def __init__(
        self,
        redis: Redis,
        keys: KeySpace,
        *,
        poll_s: float = POLL_S,
        name: str | None = None,
        max_pending: int = MAX_PENDING,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.poll_s = poll_s
        self.name = name or router_name()
        self.max_pending = max_pending
        self.rng = rng
        self.setting: CaptureSetting | None = None
        """The capture in force; None while capture is off."""
        self.written = 0
        self.dropped = 0
        """Records lost: the queue was full, or Redis failed the write."""
        self._pending: deque[_Finished] = deque()
        self._wake = asyncio.Event()
        self._greeted = ""
        self._unreadable: bytes | str | None = None
        self._poll_failing = False
        self._write_failing = False
        self._closing = False

    # -- the request path ---------------------------------------------------------------------

    def admit(self, observed: ObservedRequest | None = None) -> Ticket | None:
        """A ticket when the request entering the flow now is to be recorded, else None."""
        setting = self.setting
        if setting is None:
            return None
        now = time.time()
        if now >= setting.until or (setting.sample < 1.0 and self.rng() >= setting.sample):
            return None
        arrival = observed.accepted_ns / 1e9 if observed is not None else now
        return Ticket(self, setting, arrival)

    def queue(self, finished: _Finished) -> None:
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append(finished)
        self._wake.set()

    # -- the setting --------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the setting once; say hello to a capture seen for the first time."""
        raw = await self.redis.get(self.keys.capture)
        setting = None
        if raw is not None:
            try:
                setting = CaptureSetting.from_json(raw)
            except InvalidArgumentError as err:
                if raw != self._unreadable:  # once per value, not once per poll
                    logger.error("ignoring an unreadable capture setting (capture off): %s", err)
                self._unreadable = raw
        if setting is not None and time.time() >= setting.until:
            setting = None
        if (setting is None) != (self.setting is None):
            logger.info("traffic capture %s", "off" if setting is None else f"on: {setting}")
        self.setting = setting
        if setting is not None and setting.id != self._greeted:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(
                    self.keys.capture_stream,
                    {FIELD_CAPTURE: setting.id, FIELD_HELLO: self.name},
                    maxlen=STREAM_MAX_LEN,
                    approximate=True,
                )
                pipe.expire(self.keys.capture_stream, STREAM_TTL_S)
                await pipe.execute()
            self._greeted = setting.id

    async def follow(self) -> None:
        """Poll the setting until cancelled; a Redis outage is logged once, and the setting
        last read holds meanwhile (it ends by its ``until`` anyway)."""
        while True:
            try:
                await self.refresh()
                if self._poll_failing:
                    logger.info("reading the capture setting works again")
                self._poll_failing = False
            except (RedisError, OSError) as err:
                if not self._poll_failing:
                    logger.warning("cannot read the capture setting: %s", err)
                self._poll_failing = True
            await asyncio.sleep(self.poll_s)  # the poll period

    # -- the records --------------------------------------------------------------------------

    async def write_pending(self) -> None:
        """Write the queued records, a batch at a time; a batch Redis fails is dropped."""
        while self._pending:
            batch = [self._pending.popleft() for _ in range(min(WRITE_BATCH, len(self._pending)))]
            # Hashing a long prompt takes milliseconds: off the event loop.
            entries = await asyncio.to_thread(_entries, batch)
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for entry in entries:
                        pipe.xadd(
                            self.keys.capture_stream,
                            entry,  # type: ignore[arg-type]
                            maxlen=STREAM_MAX_LEN,
                            approximate=True,
                        )
                    pipe.expire(self.keys.capture_stream, STREAM_TTL_S)
                    await pipe.execute()
            except (RedisError, OSError) as err:
                self.dropped += len(batch)
                if not self._write_failing:
                    logger.warning("dropping captured records, Redis failed: %s", err)
                self._write_failing = True
                continue
            self.written += len(batch)
            if self._write_failing:
                logger.info("writing captured records works again")
            self._write_failing = False

    async def write(self) -> None:
        """Write records as requests end, until cancelled or, once ``close`` was called,
        until the queue is empty."""
        while not self._closing or self._pending:
            await self._wake.wait()
            self._wake.clear()
            await self.write_pending()

    def close(self) -> None:
        """Admit nothing more; ``write`` ends once it has written what is queued."""
        self.setting = None
        self._closing = True
        self._wake.set()


@contextlib.asynccontextmanager
async def capturing(capture: Capture) -> AsyncIterator[Capture]:
    """Run ``capture``'s poll and writer while inside: two tasks, the poll cancelled on the
    way out, the writer given 2 s to write the records still queued."""
    try:
        await capture.refresh()
    except (RedisError, OSError) as err:  # the poll keeps trying
        logger.warning("cannot read the capture setting yet: %s", err)
    poll = asyncio.create_task(capture.follow(), name="capture-follow")
    writer = asyncio.create_task(capture.write(), name="capture-write")
    try:
        yield capture
    finally:
        capture.close()
        await cancel_and_wait(poll)
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(writer, 2.0)  # cancels it when the time is up
