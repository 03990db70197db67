"""The gateway's worker threads: the CPU work of a request body, off the event loop.

Parsing a body, validating it, rendering a chat template and tokenizing the prompt cost time
in proportion to the body. On the event loop, a large body would hold every other request
(and every stream's next token) for that long; so a body larger than ``INLINE_BYTES`` is
prepared on one of ``threads`` threads (a bound: more such bodies wait their turn, in order),
while a small one, which costs less than a thread hand-off is worth, is prepared inline.

``counts`` says where the work ran.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pdserve.errors import InvalidArgumentError

T = TypeVar("T")

DEFAULT_THREADS = 2
INLINE_BYTES = 4096
"""Bodies up to this size are prepared on the event loop (a few hundred microseconds)."""


@dataclass(slots=True)
class PoolCounts:
    """Where bodies were prepared, since the pool started."""

    inline: int = 0
    pooled: int = 0
    """Handed to a worker thread (finished or not)."""
    busy: int = 0
    """On a worker thread now, or waiting for one."""


class WorkPool:
    """``threads`` worker threads for request bodies over ``INLINE_BYTES``."""

    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        if threads < 1:
            raise InvalidArgumentError("--parse-threads", f"must be >= 1, got {threads}")
        self.counts = PoolCounts()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gw-body")

    async def run(self, size: int, work: Callable[[], T]) -> T:
        """``work()`` for a body of ``size`` bytes: inline when small, else on a thread. A
        caller cancelled while its work waits for a thread takes it out of the queue."""
        if size <= INLINE_BYTES:
            self.counts.inline += 1
            return work()
        self.counts.pooled += 1
        self.counts.busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work)
        finally:
            self.counts.busy -= 1

    def close(self) -> None:
        """Stop the threads; work not started is dropped (its callers are gone)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
