"""The router calls of one HTTP request, raced against the client's disconnect, and the
Server-Sent Events they become.

``RouterCalls.first`` starts a streamed request's calls and waits for the first delta, so that
a request the router refuses (400, 429, 503) gets its HTTP status instead of a 200 stream
holding an error; ``RouterCalls.all`` waits for every choice of a unary one. Either way a
client that goes away cancels the calls (``until_disconnect``), and a router error becomes the
``GatewayError`` of its HTTP status, naming the OpenAI parameter at fault
(``errors.from_client_error``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

from pdserve.client import AsyncClient, Completion, Delta, PdServeClientError
from pdserve.gateway.errors import SERVER_ERROR, GatewayError, from_client_error
from pdserve.gateway.generation import Job, generate_all, stream_all

T = TypeVar("T")
Watch = Callable[[], Awaitable[None]]
"""Resolves when the HTTP client has gone away."""
DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):  # noqa: N818 - reads as what happened
    """The HTTP client closed the connection before the answer was ready."""


async def until_disconnect(watch: Watch, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then it is cancelled (which cancels
    the router calls) and ``ClientDisconnected`` is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)  # outcome taken above


def sse(obj: BaseModel) -> str:
    """One Server-Sent Events message holding ``obj`` as JSON."""
    return f"data: {obj.model_dump_json()}\n\n"


@dataclass(frozen=True, slots=True)
class Params:
    """The OpenAI parameters a router error about the prompt or ``max_tokens`` names."""

    prompt: str
    max_tokens: str = "max_tokens"
    guide: str | None = None
    """What a guide error names when the gateway made the guide (``tools``); None: the
    guide's own field."""


@dataclass(frozen=True, slots=True)
class RouterCalls:
    """The calls of one HTTP request (see the module docstring)."""

    client: AsyncClient
    timeout_s: float | None
    api_key: str | None
    params: Params

    def error(self, err: PdServeClientError) -> GatewayError:
        return from_client_error(
            err, prompt_param=self.params.prompt, max_tokens_param=self.params.max_tokens,
            api_key_sent=self.api_key is not None, guide_param=self.params.guide,
        )  # fmt: skip

    async def first(
        self, watch: Watch, jobs: list[Job]
    ) -> tuple[tuple[int, Delta], AsyncGenerator[tuple[int, Delta], None]]:
        """Start the streams and wait for the first delta."""
        deltas = stream_all(self.client, jobs, self.timeout_s, self.api_key)
        try:
            return await until_disconnect(watch, anext(deltas)), deltas
        except PdServeClientError as err:
            raise self.error(err) from err
        except StopAsyncIteration:
            raise GatewayError(SERVER_ERROR, "the router sent no answer") from None

    async def all(self, watch: Watch, jobs: list[Job]) -> list[Completion]:
        """Every job's completion, in job order."""
        try:
            return await until_disconnect(
                watch, generate_all(self.client, jobs, self.timeout_s, self.api_key)
            )
        except PdServeClientError as err:
            raise self.error(err) from err
