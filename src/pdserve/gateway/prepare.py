"""A request body's bytes -> a request ready for the router, or the 4xx that refuses it.

This is the CPU work of a request, run on the gateway's worker threads for a large body
(``pool``): the body parsed and validated (``body``), the model and the parameters the gateway
cannot honour checked, and the prompt checked against what the model and the router take,
before anything is sent:

* a prompt of token ids (completions) or a tokenized conversation (chat) of ``max_model_len``
  tokens or more, or more than the router's ``max_prompt_tokens``; a text prompt of more UTF-8
  bytes than the router's text bound (``RequestLimits``); a chat template's output over that
  same bound (refused before it is tokenized): each a 400 naming ``prompt`` or ``messages``,
  code ``context_length_exceeded``, with the limit in the message. Retrying cannot help, so
  none of them is a 429;
* more stop strings, stop characters or stop token ids than the router takes: a 400 naming
  ``stop``/``stop_token_ids``;
* more than ``MAX_CHOICES`` choices (prompts of a batch times ``n``).

A text prompt of completions is tokenized by the router, which then checks its length in
tokens; a chat prompt is rendered with the chat template and tokenized here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.client import ModelInfo
from pdserve.errors import InvalidArgumentError
from pdserve.gateway.body import parse_body
from pdserve.gateway.chat import ChatTemplate
from pdserve.gateway.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    NOT_FOUND,
    GatewayError,
    bad_request,
)
from pdserve.gateway.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from pdserve.router.limits import RequestLimits
from pdserve.router.request import ModelLimits
from pdserve.tokenizer import Tokenizer

MIN_VALUES = 65_536
VALUES_PER_TOKEN = 4
"""A body holds at most ``max(MIN_VALUES, VALUES_PER_TOKEN * max_model_len)`` JSON values:
room for a batch of prompts as token ids, and a bound on the work of validating it."""


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    body: CompletionRequest
    prompts: list[str | list[int]]
    """Each prompt of the batch: text (the router tokenizes it) or token ids."""


@dataclass(frozen=True, slots=True)
class PreparedChat:
    body: ChatCompletionRequest
    prompt_ids: list[int]
    """The conversation rendered by the chat template, tokenized."""
    max_tokens_param: str
    """``max_tokens`` or ``max_completion_tokens``, as the caller spelt it."""
    max_tokens: int
    """As asked, or the rest of the context."""


def _refusal(err: InvalidArgumentError, code: str = "invalid_value") -> GatewayError:
    return bad_request(err.field, str(err).removeprefix(f"{err.field}: "), code=code)


class Preparer:
    """The checks and conversions of both endpoints, for one model."""

    def __init__(
        self,
        model_names: tuple[str, ...],
        tokenizer: Tokenizer,
        limits: ModelLimits,
        template: ChatTemplate,
    ) -> None:
        self.model_names = model_names
        """The ``model`` values taken (the first is the served name)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.template = template
        self.max_values = max(MIN_VALUES, VALUES_PER_TOKEN * limits.max_model_len)

    def _request_limits(self, router: ModelInfo | None) -> RequestLimits:
        """The router's limits: its own ``max_prompt_tokens``, the defaults for the rest."""
        tokens = router.max_prompt_tokens if router is not None else None
        return RequestLimits.for_model(self.limits.max_model_len, max_prompt_tokens=tokens or None)

    def _check(self, body: CompletionRequest | ChatCompletionRequest, choices: int) -> None:
        if body.model and body.model not in self.model_names:
            raise GatewayError(
                NOT_FOUND,
                f"The model `{body.model}` does not exist; this server has "
                f"`{self.model_names[0]}`.",
                param="model",
                code="model_not_found",
            )
        for param, why in body.unsupported():
            raise bad_request(param, why, code="unsupported")
        if choices > MAX_CHOICES:
            param = "n" if choices == body.n else "prompt"
            raise bad_request(
                param, f"{choices} choices (prompts times n); this server makes {MAX_CHOICES} "
                "at most per request",
            )  # fmt: skip

    @staticmethod
    def _check_sampling(body: SamplingFields, limits: RequestLimits) -> None:
        try:
            limits.check_stops(body.stop_strings(), field="stop")
            limits.check_stop_token_ids(len(body.stop_token_ids or ()), field="stop_token_ids")
        except InvalidArgumentError as err:
            raise _refusal(err) from err

    def _check_tokens(self, count: int, param: str, limits: RequestLimits) -> None:
        most = self.limits.max_model_len
        if count >= most:
            raise bad_request(
                param, f"the prompt is {count} tokens; this model takes fewer than {most} "
                "(prompt plus generated tokens)", code=CONTEXT_LENGTH_EXCEEDED,
            )  # fmt: skip
        try:
            limits.check_prompt_tokens(count, field=param)
        except InvalidArgumentError as err:
            raise _refusal(err, CONTEXT_LENGTH_EXCEEDED) from err

    @staticmethod
    def _check_text(text: str, param: str, limits: RequestLimits) -> None:
        try:
            limits.check_prompt_text(text, field=param)
        except InvalidArgumentError as err:
            raise _refusal(err, CONTEXT_LENGTH_EXCEEDED) from err

    def completion(self, raw: bytes, router: ModelInfo | None) -> PreparedCompletion:
        """``POST /v1/completions``: the body and its prompts, checked."""
        body = parse_body(raw, CompletionRequest, self.max_values)
        prompts = body.prompts()
        self._check(body, len(prompts) * body.n)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("prompt", "the prompt must not be empty")
        limits = self._request_limits(router)
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_text(prompt, "prompt", limits)
            else:
                self._check_tokens(len(prompt), "prompt", limits)
        self._check_sampling(body, limits)
        return PreparedCompletion(body, prompts)

    def chat(self, raw: bytes, router: ModelInfo | None) -> PreparedChat:
        """``POST /v1/chat/completions``: the body and its prompt's token ids, checked."""
        body = parse_body(raw, ChatCompletionRequest, self.max_values)
        self._check(body, body.n)
        limits = self._request_limits(router)
        self._check_sampling(body, limits)
        try:
            text = self.template.render(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                extra=body.chat_template_kwargs,
            )
        except InvalidArgumentError as err:
            raise bad_request("messages", str(err).removeprefix("messages: ")) from err
        self._check_text(text, "messages", limits)  # before the tokenizer spends time on it
        # The template wrote any BOS. The library's batch call lets the event loop run.
        ids = self.tokenizer.encode(text, add_bos=False, release_gil=True)
        if not ids:
            raise bad_request("messages", "the conversation renders to an empty prompt")
        self._check_tokens(len(ids), "messages", limits)
        max_param, max_tokens = body.max_tokens_param()
        if max_tokens is None:  # up to the context, as OpenAI
            max_tokens = self.limits.max_model_len - len(ids)
        return PreparedChat(body, ids, max_param, max_tokens)
