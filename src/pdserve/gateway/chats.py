"""``POST /v1/chat/completions``: a conversation -> assistant messages, whole or streamed.

The conversation is rendered with the chat template and tokenized (``prepare``), sent ``n``
times (``generation``), and the answers become OpenAI's choices with chat ``logprobs``
(``render``), vLLM's ``prompt_logprobs`` (once, for the one prompt) and ``token_ids`` when
asked. A stream opens each choice with a chunk whose delta is ``{"role": "assistant",
"content": ""}``, as OpenAI does.

With tools (other than ``tool_choice: "none"``) each choice's text is read for calls
(``toolparse`` whole, ``toolstream`` as it streams): the message's ``content`` is the text
around them and ``tool_calls`` the calls, and ``finish_reason`` is ``tool_calls`` when the
model stopped after making some. A streamed piece whose text is held back (it may begin a
call) and that carries nothing else sends no chunk.
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
from pdserve.gateway.toolparse import CallRules, parse
from pdserve.gateway.toolstream import CallStream, call_stream


def _tier(body: ChatCompletionRequest) -> str | None:
    """The tier answered: the one tier there is, when the request named one."""
    return "default" if body.service_tier is not None else None


def _logprobs(
    body: ChatCompletionRequest, text: render.TokenTexts, done: ClientCompletion | Delta
) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    return render.chat_logprobs(text, done.token_ids, done.logprobs, done.top_logprobs)


def _finish(reason: str | None, calls: int) -> str | None:
    """``tool_calls`` for an answer that stopped after making calls (one cut short keeps
    ``length``)."""
    return "tool_calls" if calls and reason == "stop" else reason


def _message(
    text: str, reason: str | None, rules: CallRules | None
) -> tuple[AssistantMessage, str | None]:
    """A whole choice's message and finish reason (``rules``: how it holds calls, if read)."""
    if rules is None:
        return AssistantMessage(content=text), reason
    parsed = parse(text, rules)
    message = AssistantMessage(content=parsed.content, tool_calls=parsed.calls or None)
    return message, _finish(reason, len(parsed.calls))


async def chat(
    served: Served, raw: bytes, watch: Watch, api_key: str | None
) -> ChatCompletion | AsyncIterator[str]:
    """``raw``: the body's bytes (``body.read_body``), after the caller's key was admitted."""
    router = served.callers.info
    prepared = await served.pool.run(len(raw), lambda: served.preparer.chat(raw, router))
    body = prepared.body
    rid = response_id("chatcmpl", body.request_id)
    jobs = plan_jobs([prepared.prompt_ids], body.n, prepared.options, rid)
    tools = prepared.tools
    rules = tools.rules(served.config.tool_call_parser) if tools is not None else None
    guide = "tools" if tools is not None and tools.guided else None
    calls = served.calls(api_key, Params("messages", prepared.max_tokens_param, guide))
    text = render.TokenTexts(served.tokenizer, body.return_tokens_as_token_ids)
    name = served.config.model_name
    if body.stream:
        first, deltas = await calls.first(watch, jobs)
        return _events(body, text, calls, name, rid, first, deltas, len(prepared.prompt_ids), rules)
    done = await calls.all(watch, jobs)
    choices = []
    for i, c in enumerate(done):
        message, reason = _message(c.text, c.finish_reason, rules)
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=_logprobs(body, text, c),
                finish_reason=reason,
                token_ids=c.token_ids if body.return_token_ids else None,
            )
        )
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
    rules: CallRules | None,
) -> AsyncIterator[str]:
    created = int(time.time())
    tally = render.StreamTally(body.n)
    readers: dict[int, CallStream] = {}

    def message(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=name, choices=choices,
                                       usage=usage, service_tier=_tier(body)))  # fmt: skip

    def chunk(index: int, delta: Delta) -> str | None:
        tally.add_final(index, delta)
        reason = delta.finish_reason
        said = ChatDelta(content=delta.text)
        if rules is not None:
            reader = readers.get(index) or readers.setdefault(index, call_stream(rules))
            said = reader.feed(delta.text, final=reason is not None)
            reason = _finish(reason, reader.calls)
        choice = ChatChunkChoice(
            index=index,
            delta=said,
            logprobs=_logprobs(body, text, delta),
            finish_reason=reason,
            token_ids=delta.token_ids if body.return_token_ids else None,
        )
        usage = tally.so_far(index, prompt_tokens) if body.continuous_usage() else None
        if (
            rules is not None
            and usage is None
            and choice == ChatChunkChoice(index=index, delta=ChatDelta())
        ):
            return None  # text held back, and nothing else to send
        return message([choice], usage)

    async with contextlib.aclosing(deltas):
        try:
            opening = ChatDelta(role="assistant", content="")
            for index in range(body.n):  # OpenAI opens each choice with the role
                usage = tally.so_far(index, prompt_tokens) if body.continuous_usage() else None
                yield message([ChatChunkChoice(index=index, delta=opening)], usage)
            if (sent := chunk(*first)) is not None:
                yield sent
            async for index, delta in deltas:
                if (sent := chunk(index, delta)) is not None:
                    yield sent
        except PdServeClientError as err:
            yield sse(calls.error(err).body())
        else:
            if body.include_usage():
                yield message([], tally.usage())
    yield DONE
