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
* more than ``MAX_CHOICES`` choices (prompts of a batch times ``n``);
* a field outside the schemas (unless ``--allow-unknown-fields``), or one set to something
  pdserve does not do (``fields``);
* a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (``tools``): the
  tools go to the chat template, and ``tool_choice`` ``required`` or a named function becomes
  the request's guide (refused alongside another guide, naming ``tool_choice``).

A text prompt of completions is tokenized by the router, which then checks its length in
tokens, unless the request asks for ``add_special_tokens: false``, ``truncate_prompt_tokens``
or ``stream_options.continuous_usage_stats``: then it is tokenized here; a chat prompt is
rendered with the chat template and tokenized here. The request's fields become the SDK's
keyword arguments (``RequestOptions``) here too, one to one (``logit_bias``'s string keys as
token ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

from pydantic import BaseModel

from pdserve.client import ModelInfo, RequestOptions
from pdserve.errors import InvalidArgumentError
from pdserve.gateway.body import BODY_CODE, parse_body
from pdserve.gateway.chat import ChatTemplate
from pdserve.gateway.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    NOT_FOUND,
    GatewayError,
    bad_request,
)
from pdserve.gateway.fields import refusals, unknown_fields
from pdserve.gateway.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from pdserve.gateway.tools import ToolUse, tool_use
from pdserve.router.limits import RequestLimits
from pdserve.router.request import ModelLimits
from pdserve.tokenizer import Tokenizer

UNKNOWN_FIELD = "unknown_field"
"""``code`` of a 400 for a field outside the schemas."""
MIN_VALUES = 65_536
VALUES_PER_TOKEN = 4
"""A body holds at most ``max(MIN_VALUES, VALUES_PER_TOKEN * max_model_len)`` JSON values:
room for a batch of prompts as token ids, and a bound on the work of validating it."""


class ChatPromptFields(Protocol):
    """What makes a chat prompt: the fields of a chat request and of ``/tokenize``'s."""

    messages: list[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    documents: list[dict[str, str]] | None
    chat_template_kwargs: dict[str, Any] | None
    add_special_tokens: bool


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    body: CompletionRequest
    prompts: list[str | list[int]]
    """Each prompt of the batch: text (the router tokenizes it) or token ids."""
    options: RequestOptions


@dataclass(frozen=True, slots=True)
class PreparedChat:
    body: ChatCompletionRequest
    prompt_ids: list[int]
    """The conversation rendered by the chat template, tokenized."""
    max_tokens_param: str
    """``max_tokens`` or ``max_completion_tokens``, as the caller spelt it."""
    options: RequestOptions
    """``max_tokens`` as asked, or the rest of the context; a guide of the tools' own when
    ``tool_choice`` is ``required`` or names a function."""
    tools: ToolUse | None = None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string keys as token ids (the router checks them against the vocabulary)."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request("logit_bias", f"key {key!r} is not a token id")
        out[int(key)] = value
    return out


def request_options(
    body: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> RequestOptions:
    """The SDK's keyword arguments of ``body``: every field maps to the one of its name."""
    return RequestOptions(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop_strings(),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        logit_bias=_logit_bias(body.logit_bias),
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        **_guided(body),
    )


def _guided(body: SamplingFields) -> RequestOptions:
    """vLLM's ``guided_*`` fields and OpenAI's ``response_format`` as the SDK's ``guided_*``
    keywords (at most one kind; ``json_schema``'s ``schema`` is a ``guided_json``)."""
    out: dict[str, Any] = {}  # the keys are RequestOptions' guided_* ones
    for name, types in (("guided_json", (dict, str)), ("guided_regex", str),
                        ("guided_choice", list), ("guided_grammar", str)):  # fmt: skip
        value = getattr(body, name)
        if value is None:
            continue
        if not isinstance(value, types) or (name == "guided_choice" and not all(
                isinstance(c, str) for c in value)):  # fmt: skip
            raise bad_request(name, f"has the wrong type ({type(value).__name__})")
        out[name] = value
    fmt = body.response_format
    if fmt is not None and fmt.get("type") not in (None, "text"):
        kind = fmt.get("type")
        if kind == "json_object":
            out["guided_json_object"] = True
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema", "must be a JSON object")
            out["guided_json"] = schema
        else:
            raise bad_request("response_format.type", "must be text, json_object or json_schema")
    if len(out) > 1:
        raise bad_request(next(iter(out)), f"give one kind of guide, not {', '.join(out)}")
    return cast(RequestOptions, out)


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
        *,
        allow_unknown_fields: bool = False,
    ) -> None:
        self.model_names = model_names
        """The ``model`` values taken (the first is the served name)."""
        self.allow_unknown_fields = allow_unknown_fields
        """Ignore fields outside the schemas instead of refusing them (``fields``)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.template = template
        self.max_values = max(MIN_VALUES, VALUES_PER_TOKEN * limits.max_model_len)

    def request_limits(self, router: ModelInfo | None) -> RequestLimits:
        """The router's limits: its own ``max_prompt_tokens``, the defaults for the rest."""
        tokens = router.max_prompt_tokens if router is not None else None
        return RequestLimits.for_model(self.limits.max_model_len, max_prompt_tokens=tokens or None)

    def check_model(self, model: str | None) -> None:
        """A 404 for a ``model`` this server does not serve (None: the one it serves)."""
        if model and model not in self.model_names:
            raise GatewayError(
                NOT_FOUND,
                f"The model `{model}` does not exist; this server has `{self.model_names[0]}`.",
                param="model",
                code="model_not_found",
            )

    def check_fields(self, body: BaseModel) -> None:
        """A 400 naming the first field outside the schemas, unless they are allowed."""
        if self.allow_unknown_fields:
            return
        for where, key in unknown_fields(body):
            why = (
                "unknown field: neither OpenAI's nor vLLM's request has it (the gateway's "
                "--allow-unknown-fields ignores such fields)"
            )
            if not key:  # no name to give: the object that holds it, or the body as a whole
                code = UNKNOWN_FIELD if where else BODY_CODE
                raise bad_request(where or None, f'a key "" is an {why}', code=code)
            raise bad_request(f"{where}.{key}" if where else key, why, code=UNKNOWN_FIELD)

    def _check(self, body: CompletionRequest | ChatCompletionRequest, choices: int) -> None:
        self.check_fields(body)
        self.check_model(body.model)
        for param, why in refusals(body):
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
    def check_text(text: str, param: str, limits: RequestLimits) -> None:
        try:
            limits.check_prompt_text(text, field=param)
        except InvalidArgumentError as err:
            raise _refusal(err, CONTEXT_LENGTH_EXCEEDED) from err

    def _truncated(self, ids: list[int], keep: int | None) -> list[int]:
        return ids[-keep:] if keep is not None else ids

    def completion(self, raw: bytes, router: ModelInfo | None) -> PreparedCompletion:
        """``POST /v1/completions``: the body and its prompts, checked."""
        body = parse_body(raw, CompletionRequest, self.max_values)
        texts = body.prompts()
        self._check(body, len(texts) * body.n)
        if not texts or any(len(p) == 0 for p in texts):
            raise bad_request("prompt", "the prompt must not be empty")
        limits = self.request_limits(router)
        # Tokenized here when the request needs its ids, or their number on every chunk.
        here = (
            not body.add_special_tokens
            or body.truncate_prompt_tokens is not None
            or (body.stream and body.continuous_usage())
        )
        prompts: list[str | list[int]] = []
        for prompt in texts:
            if isinstance(prompt, str):
                self.check_text(prompt, "prompt", limits)
                if not here:  # the router tokenizes it and checks its length
                    prompts.append(prompt)
                    continue
                prompt = self.tokenizer.encode(prompt, body.add_special_tokens, release_gil=True)
            prompt = self._truncated(prompt, body.truncate_prompt_tokens)
            self._check_tokens(len(prompt), "prompt", limits)
            prompts.append(prompt)
        self._check_sampling(body, limits)
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo and body.logprobs is not None:
            prompt_logprobs = body.logprobs  # the echoed prompt's logprobs, as vLLM gives them
        options = request_options(
            body, max_tokens=body.max_tokens, logprobs=body.logprobs,
            prompt_logprobs=prompt_logprobs,
        )  # fmt: skip
        return PreparedCompletion(body, prompts, options)

    def chat(self, raw: bytes, router: ModelInfo | None) -> PreparedChat:
        """``POST /v1/chat/completions``: the body and its prompt's token ids, checked."""
        body = parse_body(raw, ChatCompletionRequest, self.max_values)
        self._check(body, body.n)
        tools = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls)
        guide = tools.guide() if tools is not None else None
        if guide is not None and _guided(body):
            what = '"required"' if body.tool_choice == "required" else "a named function"
            fmt = body.response_format or {}
            given = "guided_*" if fmt.get("type") in (None, "text") else "response_format"
            raise bad_request(
                "tool_choice", f"{what} guides the answer itself: it cannot be combined with "
                f"{given}",
            )  # fmt: skip
        limits = self.request_limits(router)
        self._check_sampling(body, limits)
        ids = self.chat_prompt(body, limits, body.truncate_prompt_tokens, tools)
        max_param, max_tokens = body.max_tokens_param()
        if max_tokens is None:  # up to the context, as OpenAI
            max_tokens = self.limits.max_model_len - len(ids)
        options = request_options(
            body, max_tokens=max_tokens,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            prompt_logprobs=body.prompt_logprobs,
        )  # fmt: skip
        if guide is not None:
            options["guided_json"] = guide
        return PreparedChat(body, ids, max_param, options, tools)

    def chat_prompt(
        self,
        body: ChatPromptFields,
        limits: RequestLimits,
        truncate: int | None = None,
        tools: ToolUse | None = None,
    ) -> list[int]:
        """The conversation (with its ``tools``) rendered by the chat template and tokenized
        (its last ``truncate`` tokens), checked."""
        try:
            text = self.template.render(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                documents=body.documents,
                extra=body.chat_template_kwargs,
                tools=tools.template_tools() if tools is not None else None,
            )
        except InvalidArgumentError as err:
            raise bad_request(err.field, str(err).removeprefix(f"{err.field}: ")) from err
        self.check_text(text, "messages", limits)  # before the tokenizer spends time on it
        # The template wrote any BOS. The library's batch call lets the event loop run.
        ids = self.tokenizer.encode(text, add_bos=body.add_special_tokens, release_gil=True)
        ids = self._truncated(ids, truncate)
        if not ids:
            raise bad_request("messages", "the conversation renders to an empty prompt")
        self._check_tokens(len(ids), "messages", limits)
        return ids
