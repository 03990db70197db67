"""``POST /v1/completions``: prompts -> choices, whole or as Server-Sent Events.

The body is prepared (``prepare``; on a worker thread when large), each prompt times ``n``
becomes a router request (``generation``), and the answers become OpenAI's choices: the text
(after the echoed prompt with ``echo``), legacy ``logprobs`` (``render``), vLLM's
``prompt_logprobs`` and ``token_ids`` when asked. A stream sends one chunk per piece the router
streams, the echoed prompt with the first piece of each choice.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from pdserve.client import Completion as ClientCompletion
from pdserve.client import Delta, PdServeClientError
from pdserve.gateway import render
from pdserve.gateway.calls import DONE, Params, RouterCalls, Watch, sse
from pdserve.gateway.generation import plan_jobs
from pdserve.gateway.prepare import PreparedCompletion
from pdserve.gateway.protocol import CompletionRequest
from pdserve.gateway.responses import Completion, CompletionChoice
from pdserve.gateway.served import Served, response_id
from pdserve.logprobs import PromptLogprobs

PARAMS = Params(prompt="prompt")


@dataclass(frozen=True, slots=True)
class _Choices:
    """How the choices of one request are written."""

    body: CompletionRequest
    text: render.TokenTexts
    echoed: list[str]
    """Each prompt's text, for ``echo``."""
    prompt_tokens: list[int]
    """Each prompt's tokens, where the gateway tokenized it (0: the router did)."""

    @classmethod
    def of(cls, served: Served, prepared: PreparedCompletion) -> _Choices:
        body = prepared.body
        echoed: list[str] = []
        if body.echo:  # the prompt as sent, unless only its (truncated) tokens went out
            for sent, prompt in zip(body.prompts(), prepared.prompts, strict=True):
                if isinstance(sent, str) and body.truncate_prompt_tokens is None:
                    echoed.append(sent)
                elif isinstance(prompt, list):
                    echoed.append(served.tokenizer.decode(prompt, body.skip_special_tokens))
        as_ids = body.return_tokens_as_token_ids
        counts = [0 if isinstance(p, str) else len(p) for p in prepared.prompts]
        return cls(body, render.TokenTexts(served.tokenizer, as_ids), echoed, counts)

    def echo_of(self, index: int) -> str:
        """The text ``echo`` puts before choice ``index``'s ("" without echo)."""
        return self.echoed[index // self.body.n] if self.body.echo else ""

    def choice(
        self,
        index: int,
        done: ClientCompletion | Delta,
        *,
        echo: str = "",
        offset: int = 0,
        prompt: PromptLogprobs | None = None,
    ) -> CompletionChoice:
        """Choice ``index`` of the whole answer, or one streamed piece of it: ``echo`` (the
        prompt, on the choice's first piece) and then the text, which starts at ``offset`` in
        the choice's text; ``prompt``: the prompt's logprobs (the first piece's)."""
        body = self.body
        logprobs = None
        if body.logprobs is not None:
            logprobs = render.completion_logprobs(
                self.text, done.token_ids, done.logprobs, done.top_logprobs,
                offset=offset + len(echo), prompt=prompt if echo else None,
            )  # fmt: skip
        return CompletionChoice(
            index=index,
            text=echo + done.text,
            logprobs=logprobs,
            finish_reason=done.finish_reason,
            token_ids=done.token_ids if body.return_token_ids else None,
            prompt_logprobs=render.prompt_logprob_list(self.text, prompt)
            if body.prompt_logprobs is not None
            else None,
        )


async def completions(
    served: Served, raw: bytes, watch: Watch, api_key: str | None
) -> Completion | AsyncIterator[str]:
    """``raw``: the body's bytes (``body.read_body``), after the caller's key was admitted."""
    router = served.callers.info
    prepared = await served.pool.run(len(raw), lambda: served.preparer.completion(raw, router))
    body = prepared.body
    rid = response_id("cmpl", body.request_id)
    jobs = plan_jobs(prepared.prompts, body.n, prepared.options, rid)
    calls = served.calls(api_key, PARAMS)
    choices = _Choices.of(served, prepared)
    name = served.config.model_name
    if body.stream:
        first, deltas = await calls.first(watch, jobs)
        return _events(choices, calls, name, rid, first, deltas)
    done = await calls.all(watch, jobs)
    return Completion(
        id=rid,
        created=int(time.time()),
        model=name,
        choices=[
            choices.choice(i, c, echo=choices.echo_of(i), prompt=c.prompt_logprobs)
            for i, c in enumerate(done)
        ],
        usage=render.batch_usage(done, body.n),
    )


async def _events(
    choices: _Choices,
    calls: RouterCalls,
    name: str,
    rid: str,
    first: tuple[int, Delta],
    deltas: AsyncGenerator[tuple[int, Delta], None],
) -> AsyncIterator[str]:
    created = int(time.time())
    body = choices.body
    tally = render.StreamTally(body.n)

    def chunk(index: int, delta: Delta) -> str:
        echo = choices.echo_of(index) if index not in tally.offsets else ""
        start = tally.advance(index, echo + delta.text)
        choice = choices.choice(index, delta, echo=echo, offset=start, prompt=delta.prompt_logprobs)
        tally.add_final(index, delta)
        usage = None
        if body.continuous_usage():
            usage = tally.so_far(index, choices.prompt_tokens[index // body.n])
        return sse(Completion(id=rid, created=created, model=name, choices=[choice], usage=usage))

    async with contextlib.aclosing(deltas):
        try:
            yield chunk(*first)
            async for index, delta in deltas:
                yield chunk(index, delta)
        except PdServeClientError as err:
            yield sse(calls.error(err).body())
        else:
            if body.include_usage():
                yield sse(Completion(id=rid, created=created, model=name, choices=[],
                                     usage=tally.usage()))  # fmt: skip
    yield DONE
