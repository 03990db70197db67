"""What each OpenAI endpoint does, on top of the SDK's ``AsyncClient`` (no HTTP here).

``Gateway.admit`` asks whether the router admits the caller's key (``callers``), before the
body is read. ``Gateway.completions`` and ``Gateway.chat`` take the body's bytes, prepare them
(``prepare``: parsed, checked, a chat prompt rendered and tokenized; on a worker thread for a
large body, ``pool``), turn them into router requests (``generation``), and return either a
whole response object or, for ``stream: true``, an async iterator of Server-Sent Events lines
ending in ``data: [DONE]``. ``api_key`` is the HTTP caller's key, sent with each of the
request's router calls (the router checks it and takes the tenant from it; the gateway holds
no keys). Errors raise ``GatewayError`` with the HTTP status and the OpenAI parameter at
fault. A stream's first delta is awaited before the iterator is returned, so that a request
the router refuses (400, 429, 503) gets its HTTP status instead of a 200 stream holding an
error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from pdserve.client import AsyncClient, Delta, ModelInfo, PdServeClientError, RequestOptions
from pdserve.gateway import render
from pdserve.gateway.body import DEFAULT_MAX_BODY_BYTES
from pdserve.gateway.callers import Callers
from pdserve.gateway.chat import ChatTemplate
from pdserve.gateway.errors import SERVER_ERROR, GatewayError, from_client_error
from pdserve.gateway.generation import Job, generate_all, plan_jobs, stream_all
from pdserve.gateway.pool import DEFAULT_THREADS, WorkPool
from pdserve.gateway.prepare import Preparer
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.gateway.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    ModelCard,
    ModelList,
    Usage,
)
from pdserve.router.request import ModelLimits
from pdserve.security.tls import TlsConfig
from pdserve.tokenizer import Tokenizer

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
class GatewayConfig:
    """How a gateway is set up (the service's flags)."""

    router: str
    """host:port of the Router service."""
    model_dir: Path
    """The checkpoint the cluster serves (its tokenizer, config and chat template)."""
    served_model_name: str | None = None
    """The ``model`` clients name; default: the checkpoint directory's name."""
    timeout_s: float | None = 600.0
    """Each request's deadline in the cluster; None: none."""
    chat_template: Path | None = None
    """A Jinja2 file used instead of the checkpoint's chat template."""
    router_tls: TlsConfig | None = None
    """How to reach a TLS router (its CA; a client certificate for one that demands it);
    None: plaintext."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies are refused (413) without being read."""
    parse_threads: int = DEFAULT_THREADS
    """Worker threads that prepare large bodies (``pool``)."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name


class Gateway:
    """The OpenAI endpoints of one model served by one router."""

    def __init__(
        self,
        config: GatewayConfig,
        client: AsyncClient,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        template: ChatTemplate,
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.template = template
        self.created = int(time.time())
        self.callers = Callers(client, config.timeout_s)
        self.pool = WorkPool(config.parse_threads)
        names = (config.model_name, str(config.model_dir))
        self.preparer = Preparer(names, tokenizer, limits, template)

    @classmethod
    def load(cls, config: GatewayConfig) -> Gateway:
        """Read the checkpoint's tokenizer, limits and chat template (no weights)."""
        return cls(
            config,
            AsyncClient(config.router, timeout=config.timeout_s, tls=config.router_tls or False),
            Tokenizer.from_dir(config.model_dir),
            ModelLimits.from_dir(config.model_dir),
            ChatTemplate.from_dir(config.model_dir, config.chat_template),
        )

    async def close(self) -> None:
        self.pool.close()
        await self.client.close()

    async def admit(self, api_key: str | None) -> ModelInfo:
        """The router's ``ModelInfo`` if it admits ``api_key``, else its refusal (401)."""
        return await self.callers.admit(api_key)

    # -- /v1/models, /health -------------------------------------------------------------------

    async def models(self, api_key: str | None) -> ModelList:
        """The served model, as the router reports it. The router checks ``api_key`` as it
        does for a generation, so a secured cluster lists nothing to a caller without one."""
        try:
            info = await self.client.model_info(timeout=self.config.timeout_s, api_key=api_key)
        except PdServeClientError as err:
            raise from_client_error(err, prompt_param="", api_key_sent=api_key is not None) from err
        card = ModelCard(
            id=self.config.model_name,
            created=self.created,
            root=str(self.config.model_dir),
            max_model_len=info.max_model_len,
        )
        return ModelList(data=[card])

    async def healthy(self) -> bool:
        """The router's gRPC health check says SERVING."""
        return await self.client.health()

    # -- shared ---------------------------------------------------------------------------------

    @staticmethod
    def _options(body: SamplingFields, max_tokens: int | None) -> RequestOptions:
        return RequestOptions(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_strings(),
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
        )

    async def _first(
        self,
        watch: Watch,
        jobs: list[Job],
        prompt_param: str,
        max_tokens_param: str,
        api_key: str | None,
    ) -> tuple[tuple[int, Delta], AsyncGenerator[tuple[int, Delta], None]]:
        """Start the streams and wait for the first delta (see the module docstring)."""
        deltas = stream_all(self.client, jobs, self.config.timeout_s, api_key)
        try:
            return await until_disconnect(watch, anext(deltas)), deltas
        except PdServeClientError as err:
            raise from_client_error(
                err, prompt_param=prompt_param, max_tokens_param=max_tokens_param,
                api_key_sent=api_key is not None,
            ) from err  # fmt: skip
        except StopAsyncIteration:
            raise GatewayError(SERVER_ERROR, "the router sent no answer") from None

    async def _all(
        self,
        watch: Watch,
        jobs: list[Job],
        prompt_param: str,
        max_tokens_param: str,
        api_key: str | None,
    ) -> list[render.ClientCompletion]:
        try:
            return await until_disconnect(
                watch, generate_all(self.client, jobs, self.config.timeout_s, api_key)
            )
        except PdServeClientError as err:
            raise from_client_error(
                err, prompt_param=prompt_param, max_tokens_param=max_tokens_param,
                api_key_sent=api_key is not None,
            ) from err  # fmt: skip

    # -- /v1/completions -----------------------------------------------------------------------

    async def completions(
        self, raw: bytes, watch: Watch, api_key: str | None = None
    ) -> Completion | AsyncIterator[str]:
        """``raw``: the body's bytes (``body.read_body``), after ``admit``."""
        router = self.callers.info
        prepared = await self.pool.run(len(raw), lambda: self.preparer.completion(raw, router))
        body = prepared.body
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = plan_jobs(prepared.prompts, body.n, self._options(body, body.max_tokens), rid)
        if body.stream:
            first, deltas = await self._first(watch, jobs, "prompt", "max_tokens", api_key)
            return self._completion_events(body, rid, first, deltas)
        done = await self._all(watch, jobs, "prompt", "max_tokens", api_key)
        choices = [
            CompletionChoice(
                index=i,
                text=c.text,
                finish_reason=c.finish_reason,
                logprobs=None
                if body.logprobs is None
                else render.completion_logprobs(
                    self.tokenizer, c.token_ids, c.logprobs, top=body.logprobs
                ),
                token_ids=c.token_ids if body.return_token_ids else None,
            )
            for i, c in enumerate(done)
        ]
        return Completion(
            id=rid,
            created=int(time.time()),
            model=self.config.model_name,
            choices=choices,
            usage=render.batch_usage(done, body.n),
        )

    async def _completion_events(
        self,
        body: CompletionRequest,
        rid: str,
        first: tuple[int, Delta],
        deltas: AsyncGenerator[tuple[int, Delta], None],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        tally = render.StreamTally(body.n)

        def chunk(index: int, delta: Delta) -> str:
            offset = tally.advance(index, delta.text)
            tally.add_final(index, delta)
            logprobs = None
            if body.logprobs is not None:
                logprobs = render.completion_logprobs(
                    self.tokenizer, delta.token_ids, delta.logprobs, top=body.logprobs,
                    offset=offset,
                )  # fmt: skip
            choice = CompletionChoice(
                index=index,
                text=delta.text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
            )
            return sse(Completion(id=rid, created=created, model=self.config.model_name,
                                  choices=[choice]))  # fmt: skip

        async with contextlib.aclosing(deltas):
            try:
                yield chunk(*first)
                async for index, delta in deltas:
                    yield chunk(index, delta)
            except PdServeClientError as err:
                yield sse(from_client_error(err, prompt_param="prompt").body())
            else:
                if body.include_usage():
                    yield sse(Completion(id=rid, created=created, model=self.config.model_name,
                                         choices=[], usage=tally.usage()))  # fmt: skip
        yield DONE

    # -- /v1/chat/completions ------------------------------------------------------------------

    async def chat(
        self, raw: bytes, watch: Watch, api_key: str | None = None
    ) -> ChatCompletion | AsyncIterator[str]:
        """``raw``: the body's bytes (``body.read_body``), after ``admit``."""
        router = self.callers.info
        prepared = await self.pool.run(len(raw), lambda: self.preparer.chat(raw, router))
        body, max_param = prepared.body, prepared.max_tokens_param
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = plan_jobs(
            [prepared.prompt_ids], body.n, self._options(body, prepared.max_tokens), rid
        )
        top = body.top_logprobs or 0
        if body.stream:
            first, deltas = await self._first(watch, jobs, "messages", max_param, api_key)
            return self._chat_events(body, rid, first, deltas)
        done = await self._all(watch, jobs, "messages", max_param, api_key)
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=c.text),
                logprobs=render.chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, top=top)
                if body.logprobs
                else None,
                finish_reason=c.finish_reason,
                token_ids=c.token_ids if body.return_token_ids else None,
            )
            for i, c in enumerate(done)
        ]
        return ChatCompletion(
            id=rid,
            created=int(time.time()),
            model=self.config.model_name,
            choices=choices,
            usage=render.batch_usage(done, body.n),
        )

    async def _chat_events(
        self,
        body: ChatCompletionRequest,
        rid: str,
        first: tuple[int, Delta],
        deltas: AsyncGenerator[tuple[int, Delta], None],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        tally = render.StreamTally(body.n)
        top = body.top_logprobs or 0

        def message(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=self.config.model_name,
                                           choices=choices, usage=usage))  # fmt: skip

        def chunk(index: int, delta: Delta) -> str:
            tally.add_final(index, delta)
            logprobs = None
            if body.logprobs:
                logprobs = render.chat_logprobs(
                    self.tokenizer, delta.token_ids, delta.logprobs, top=top
                )
            choice = ChatChunkChoice(
                index=index,
                delta=ChatDelta(content=delta.text),
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
            )
            return message([choice])

        async with contextlib.aclosing(deltas):
            try:
                opening = ChatDelta(role="assistant", content="")
                for index in range(body.n):  # OpenAI opens each choice with the role
                    yield message([ChatChunkChoice(index=index, delta=opening)])
                yield chunk(*first)
                async for index, delta in deltas:
                    yield chunk(index, delta)
            except PdServeClientError as err:
                yield sse(from_client_error(err, prompt_param="messages").body())
            else:
                if body.include_usage():
                    yield message([], tally.usage())
        yield DONE
