"""Streams of deltas, sync and asyncio, with retry before the first token and cancellation.

Leaving an iteration early cancels the call, so that the router frees what the request holds
and the worker stops generating. ``for delta in stream:`` iterates a generator of
``__iter__``'s that the loop alone holds: a ``break`` (or an exception) drops it, which closes
it at once, and closing it cancels the call, even while the stream object itself is still
referenced. ``async for`` does the same, but an async generator is closed by the event loop
(asyncio schedules its ``aclose()`` once it is dropped), so ``async with client.stream(...)
as stream:`` is the form that cancels at once, on leaving the block. A stream that is dropped
cancels its call too: the generator that reads the call does not refer back to the stream, so
no reference cycle keeps it alive until the garbage collector runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from typing import Any

import grpc

from pdserve.client.convert import delta_from_proto
from pdserve.client.errors import Cancelled, PdServeClientError, ServerError, error_from_rpc
from pdserve.client.request import RetryPolicy
from pdserve.client.results import Completion, CompletionBuilder, Delta


class Deadline:
    """An overall time limit across retries; None means no limit."""

    def __init__(self, timeout_s: float | None) -> None:
        self.end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())


def _unfinished() -> PdServeClientError:
    return ServerError(grpc.StatusCode.UNKNOWN, "the stream ended without a finish reason")


class _Attempts:
    """What a stream's generator shares with the stream: the call in flight, the deltas so far,
    whether the caller cancelled. The generator holds this, not the stream (see the module
    docstring)."""

    __slots__ = ("builder", "call", "cancelled", "deadline", "retry", "start")

    def __init__(
        self, start: Callable[[float | None], Any], retry: RetryPolicy, deadline: Deadline
    ) -> None:
        self.start = start
        self.retry = retry
        self.deadline = deadline
        self.call: Any = None
        self.cancelled = False
        self.builder = CompletionBuilder()

    def cancel(self) -> None:
        self.cancelled = True
        if self.call is not None:
            self.call.cancel()  # a no-op once the call has finished

    def retry_delay(self, err: grpc.RpcError, attempt: int) -> float:
        """The backoff before the next try; raises the typed error when there is none."""
        if self.cancelled:
            raise Cancelled(grpc.StatusCode.CANCELLED, "cancelled by the caller") from err
        delay = self.retry.should_retry(
            err.code(),
            attempt,
            started=self.builder.started,
            time_left_s=self.deadline.remaining(),
        )
        if delay is None:
            raise error_from_rpc(err) from err
        return delay


def _deltas(state: _Attempts) -> Generator[Delta, None, None]:
    attempt = 0
    while True:
        attempt += 1
        call = state.start(state.deadline.remaining())
        state.call = call
        try:
            for msg in call:
                delta = delta_from_proto(msg)
                state.builder.add(delta)
                yield delta
            if state.builder.last is None or not state.builder.last.finished:
                raise _unfinished()
            return
        except grpc.RpcError as err:
            delay = state.retry_delay(err, attempt)
        finally:
            call.cancel()  # a no-op once the call has finished
        time.sleep(delay)  # retry backoff


async def _async_deltas(state: _Attempts) -> AsyncGenerator[Delta, None]:
    attempt = 0
    while True:
        attempt += 1
        call = state.start(state.deadline.remaining())
        state.call = call
        try:
            async for msg in call:
                delta = delta_from_proto(msg)
                state.builder.add(delta)
                yield delta
            if state.builder.last is None or not state.builder.last.finished:
                raise _unfinished()
            return
        except grpc.RpcError as err:
            delay = state.retry_delay(err, attempt)
        except asyncio.CancelledError:
            if state.cancelled:  # cancel() on an aio call ends the iteration this way
                raise Cancelled(grpc.StatusCode.CANCELLED, "cancelled by the caller") from None
            raise
        finally:
            call.cancel()
        await asyncio.sleep(delay)  # retry backoff


class CompletionStream:
    """Iterate to receive ``Delta``s; ``completion()`` sums them up once the stream is done.

    Leaving a ``for`` loop over it early (``break``, an exception), ``cancel()``, leaving the
    ``with`` block, or dropping the stream cancels the call, which makes the router free
    everything the request held and the worker stop generating. ``next(stream)`` reads one
    delta without ending anything.
    """

    def __init__(
        self,
        start: Callable[[float | None], Any],
        retry: RetryPolicy,
        deadline: Deadline,
    ) -> None:
        self._state = _Attempts(start, retry, deadline)
        self._deltas = _deltas(self._state)

    def __iter__(self) -> Iterator[Delta]:
        # A generator the for loop alone holds: a loop left early closes it (GeneratorExit).
        # Not ``yield from``, which would close the deltas too: reading on after a ``break``
        # raises ``Cancelled``, as after ``cancel()``, rather than ending quietly.
        try:
            for delta in self._deltas:  # noqa: UP028 - see above
                yield delta
        except GeneratorExit:
            self.cancel()
            raise

    def __next__(self) -> Delta:
        return next(self._deltas)

    def cancel(self) -> None:
        """Cancel the call; iteration then raises ``Cancelled``."""
        self._state.cancel()

    def close(self) -> None:
        """Cancel the call if it is still running and end the iteration."""
        self.cancel()
        self._deltas.close()

    def completion(self) -> Completion:
        """Everything received so far, summed up (complete once the stream has ended)."""
        return self._state.builder.completion()

    def __enter__(self) -> CompletionStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncCompletionStream:
    """The asyncio counterpart of ``CompletionStream``: ``async for delta in stream``.

    ``async with client.stream(...) as stream:`` cancels the call as the block is left, a
    ``break`` included; so do ``cancel()`` and ``aclose()``. An ``async for`` left early
    without the block cancels it once the event loop has closed the dropped iterator (on its
    next turn).
    """

    def __init__(
        self,
        start: Callable[[float | None], Any],
        retry: RetryPolicy,
        deadline: Deadline,
    ) -> None:
        self._state = _Attempts(start, retry, deadline)
        self._deltas = _async_deltas(self._state)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        # An async generator the loop alone holds: asyncio closes it once it is dropped.
        try:
            async for delta in self._deltas:
                yield delta
        except GeneratorExit:
            self.cancel()
            raise

    async def __anext__(self) -> Delta:
        return await anext(self._deltas)

    def cancel(self) -> None:
        """Cancel the call; iteration then raises ``Cancelled``."""
        self._state.cancel()

    async def aclose(self) -> None:
        """Cancel the call if it is still running and end the iteration."""
        self.cancel()
        await self._deltas.aclose()

    def completion(self) -> Completion:
        """Everything received so far, summed up (complete once the stream has ended)."""
        return self._state.builder.completion()

    async def __aenter__(self) -> AsyncCompletionStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
