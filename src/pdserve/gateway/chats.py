"""``POST /v1/chat/completions``: a conversation -> assistant messages, whole or streamed.

The conversation is rendered with the chat template and tokenized (``prepare``), sent ``n``
times (``generation``), and the answers become OpenAI's choices with chat ``logprobs``
(``render``), vLLM's ``prompt_logprobs`` (once, for the one prompt) and ``token_ids`` when
asked. A stream opens each choice with a chunk whose delta is ``{"role": "assistant",
"content": ""}``, as OpenAI does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator

from pdserve.client import Completion as ClientCompletion
from pdserve.client import Delta, PdServeClientError
from pdserve.gateway import render
from pdserve.gateway.calls import DONE, Params, RouterCalls, Watch, sse
from pdserve.gateway.generation import plan_jobs
from pdserve.gateway.protocol import ChatCompletionRequest
from pdserve.gateway.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Usage,
)
from pdserve.gateway.served import Served, response_id


def _tier(body: ChatCompletionRequest) -> str | None:
    """The tier answered: the one tier there is, when the request named one."""
    return "default" if body.service_tier is not None else None


def _logprobs(
    body: ChatCompletionRequest, text: render.TokenTexts, done: ClientCompletion | Delta
) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    return render.chat_logprobs(text, done.token_ids, done.logprobs, done.top_logprobs)


async def chat(
    served: Served, raw: bytes, watch: Watch, api_key: str | None
) -> ChatCompletion | AsyncIterator[str]:
    """``raw``: the body's bytes (``body.read_body``), after the caller's key was admitted."""
    router = served.callers.info
    prepared = await served.pool.run(len(raw), lambda: served.preparer.chat(raw, router))
    body = prepared.body
    rid = response_id("chatcmpl", body.request_id)
    jobs = plan_jobs([prepared.prompt_ids], body.n, prepared.options, rid)
    calls = served.calls(api_key, Params("messages", prepared.max_tokens_param))
    text = render.TokenTexts(served.tokenizer, body.return_tokens_as_token_ids)
    name = served.config.model_name
    if body.stream:
        first, deltas = await calls.first(watch, jobs)
        return _events(body, text, calls, name, rid, first, deltas, len(prepared.prompt_ids))
    done = await calls.all(watch, jobs)
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(content=c.text),
            logprobs=_logprobs(body, text, c),
            finish_reason=c.finish_reason,
            token_ids=c.token_ids if body.return_token_ids else None,
        )
        for i, c in enumerate(done)
    ]
    prompt = done[0].prompt_logprobs if body.prompt_logprobs is not None else None
    return ChatCompletion(
        id=rid,
        created=int(time.time()),
        model=name,
        choices=choices,
        usage=render.batch_usage(done, body.n),
        service_tier=_tier(body),
        prompt_logprobs=render.prompt_logprob_list(text, prompt),
    )


async def _events(
    body: ChatCompletionRequest,
    text: render.TokenTexts,
    calls: RouterCalls,
    name: str,
    rid: str,
    first: tuple[int, Delta],
    deltas: AsyncGenerator[tuple[int, Delta], None],
    prompt_tokens: int,
) -> AsyncIterator[str]:
    created = int(time.time())
    tally = render.StreamTally(body.n)

    def message(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=name, choices=choices,
                                       usage=usage, service_tier=_tier(body)))  # fmt: skip

    def chunk(index: int, delta: Delta) -> str:
        tally.add_final(index, delta)
        choice = ChatChunkChoice(
            index=index,
            delta=ChatDelta(content=delta.text),
            logprobs=_logprobs(body, text, delta),
            finish_reason=delta.finish_reason,
            token_ids=delta.token_ids if body.return_token_ids else None,
        )
        usage = tally.so_far(index, prompt_tokens) if body.continuous_usage() else None
        return message([choice], usage)

    async with contextlib.aclosing(deltas):
        try:
            opening = ChatDelta(role="assistant", content="")
            for index in range(body.n):  # OpenAI opens each choice with the role
                usage = tally.so_far(index, prompt_tokens) if body.continuous_usage() else None
                yield message([ChatChunkChoice(index=index, delta=opening)], usage)
            yield chunk(*first)
            async for index, delta in deltas:
                yield chunk(index, delta)
        except PdServeClientError as err:
            yield sse(calls.error(err).body())
        else:
            if body.include_usage():
                yield message([], tally.usage())
    yield DONE
