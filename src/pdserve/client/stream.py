"""Streams of deltas, sync and asyncio, with retry before the first token and cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from types import TracebackType
from typing import Any

import grpc

from pdserve.client.errors import Cancelled, PdServeClientError, ServerError, error_from_rpc
from pdserve.client.request import RetryPolicy
from pdserve.client.results import Completion, CompletionBuilder, Delta
from pdserve.rpc.convert.client import delta_from_proto


class Deadline:
    """An overall time limit across retries; None means no limit."""

    def __init__(self, timeout_s: float | None) -> None:
        self.end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())


def _unfinished() -> PdServeClientError:
    return ServerError(grpc.StatusCode.UNKNOWN, "the stream ended without a finish reason")


class CompletionStream:
    """Iterate to receive ``Delta``s; ``completion()`` sums them up once the stream is done.

    ``cancel()`` (or leaving the ``with`` block early) cancels the call, which makes the router
    free everything the request held.
    """

    def __init__(
        self,
        start: Callable[[float | None], Any],
        retry: RetryPolicy,
        deadline: Deadline,
    ) -> None:
        self._start = start
        self._retry = retry
        self._deadline = deadline
        self._call: Any = None
        self._cancelled = False
        self._builder = CompletionBuilder()
        self._deltas = self._run()

    def _run(self) -> Generator[Delta, None, None]:
        attempt = 0
        while True:
            attempt += 1
            call = self._start(self._deadline.remaining())
            self._call = call
            try:
                for msg in call:
                    delta = delta_from_proto(msg)
                    self._builder.add(delta)
                    yield delta
                if self._builder.last is None or not self._builder.last.finished:
                    raise _unfinished()
                return
            except grpc.RpcError as err:
                if self._cancelled:
                    raise Cancelled(grpc.StatusCode.CANCELLED, "cancelled by the caller") from err
                delay = self._retry.should_retry(
                    err.code(),
                    attempt,
                    started=self._builder.started,
                    time_left_s=self._deadline.remaining(),
                )
                if delay is None:
                    raise error_from_rpc(err) from err
            finally:
                call.cancel()  # a no-op once the call has finished
            time.sleep(delay)  # retry backoff

    def __iter__(self) -> Iterator[Delta]:
        return self._deltas

    def __next__(self) -> Delta:
        return next(self._deltas)

    def cancel(self) -> None:
        """Cancel the call; iteration then raises ``Cancelled``."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        """Cancel the call if it is still running and end the iteration."""
        self.cancel()
        self._deltas.close()

    def completion(self) -> Completion:
        """Everything received so far, summed up (complete once the stream has ended)."""
        return self._builder.completion()

    def __enter__(self) -> CompletionStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncCompletionStream:
    """The asyncio counterpart of ``CompletionStream``: ``async for delta in stream``."""

    def __init__(
        self,
        start: Callable[[float | None], Any],
        retry: RetryPolicy,
        deadline: Deadline,
    ) -> None:
        self._start = start
        self._retry = retry
        self._deadline = deadline
        self._call: Any = None
        self._cancelled = False
        self._builder = CompletionBuilder()
        self._deltas = self._run()

    async def _run(self) -> AsyncGenerator[Delta, None]:
        attempt = 0
        while True:
            attempt += 1
            call = self._start(self._deadline.remaining())
            self._call = call
            try:
                async for msg in call:
                    delta = delta_from_proto(msg)
                    self._builder.add(delta)
                    yield delta
                if self._builder.last is None or not self._builder.last.finished:
                    raise _unfinished()
                return
            except grpc.RpcError as err:
                if self._cancelled:
                    raise Cancelled(grpc.StatusCode.CANCELLED, "cancelled by the caller") from err
                delay = self._retry.should_retry(
                    err.code(),
                    attempt,
                    started=self._builder.started,
                    time_left_s=self._deadline.remaining(),
                )
                if delay is None:
                    raise error_from_rpc(err) from err
            except asyncio.CancelledError:
                if self._cancelled:  # cancel() on an aio call ends the iteration this way
                    raise Cancelled(grpc.StatusCode.CANCELLED, "cancelled by the caller") from None
                raise
            finally:
                call.cancel()
            await asyncio.sleep(delay)  # retry backoff

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas

    async def __anext__(self) -> Delta:
        return await anext(self._deltas)

    def cancel(self) -> None:
        """Cancel the call; iteration then raises ``Cancelled``."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        """Cancel the call if it is still running and end the iteration."""
        self.cancel()
        await self._deltas.aclose()

    def completion(self) -> Completion:
        """Everything received so far, summed up (complete once the stream has ended)."""
        return self._builder.completion()

    async def __aenter__(self) -> AsyncCompletionStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
