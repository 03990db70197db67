"""vLLM's utility routes on the gateway's own tokenizer: ``POST /tokenize``, ``POST /detokenize``,
and ``GET /v1/models/{model}``.

The gateway reads the same checkpoint's tokenizer and chat template as the router, so its
token ids are the ones a generation would use:

* ``/tokenize`` ``{"model", "prompt", "add_special_tokens": true}`` -> the prompt's ids with
  the model's BOS (as a completion's text prompt); ``{"model", "messages", ...}`` -> the
  conversation (and its ``tools``) rendered by the chat template and tokenized (as a chat
  request's, without a BOS of its own unless ``add_special_tokens``). The answer is
  ``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` with ``return_token_strs``). A
  prompt over the router's text bound is refused as a generation's would be;
* ``/detokenize`` ``{"model", "tokens"}`` -> ``{"prompt"}`` (special tokens kept); an id
  outside the vocabulary is a 400 naming ``tokens[i]``.

The bodies follow the generation endpoints' rules: strict types, unknown fields refused
unless ``--allow-unknown-fields``, a ``model`` this server does not serve a 404.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pdserve.client import ModelInfo
from pdserve.gateway.body import parse_object, validate
from pdserve.gateway.errors import NOT_FOUND, GatewayError, bad_request
from pdserve.gateway.prepare import Preparer
from pdserve.gateway.protocol import Body, ChatMessage, ToolDefinition
from pdserve.gateway.responses import DetokenizeResponse, ModelCard, TokenizeResponse
from pdserve.gateway.tools import tool_use


class TokenizeCompletionRequest(Body):
    """``/tokenize`` of a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Body):
    """``/tokenize`` of a conversation (the fields of a chat request that make its prompt)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    tools: list[ToolDefinition] | None = None
    """Rendered into the prompt as a chat request's are."""


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


_CHAT_REFUSED = {
    "chat_template": "templates from the request are not taken; start the gateway with "
    "--chat-template",
    "mm_processor_kwargs": "multimodal input is not supported",
}


def tokenize(preparer: Preparer, raw: bytes, router: ModelInfo) -> TokenizeResponse:
    """``POST /tokenize`` (see the module docstring)."""
    value = parse_object(raw, preparer.max_values)
    body: TokenizeCompletionRequest | TokenizeChatRequest
    if "messages" in value:
        body = validate(value, TokenizeChatRequest)
    else:
        body = validate(value, TokenizeCompletionRequest)
    preparer.check_fields(body)
    preparer.check_model(body.model)
    limits = preparer.request_limits(router)
    if isinstance(body, TokenizeChatRequest):
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request(
                "continue_final_message", "cannot be used with add_generation_prompt: true"
            )
        for name, why in _CHAT_REFUSED.items():
            if getattr(body, name) not in (None, [], {}):
                raise bad_request(name, why, code="unsupported")
        ids = preparer.chat_prompt(body, limits, tools=tool_use(body.tools))
    else:
        preparer.check_text(body.prompt, "prompt", limits)
        ids = preparer.tokenizer.encode(body.prompt, body.add_special_tokens, release_gil=True)
    strs = None
    if body.return_token_strs:
        strs = [preparer.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return TokenizeResponse(
        count=len(ids), max_model_len=router.max_model_len, tokens=ids, token_strs=strs
    )


def detokenize(preparer: Preparer, raw: bytes) -> DetokenizeResponse:
    """``POST /detokenize`` (see the module docstring)."""
    body = validate(parse_object(raw, preparer.max_values), DetokenizeRequest)
    preparer.check_fields(body)
    preparer.check_model(body.model)
    vocab = preparer.tokenizer.vocab_size
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request(f"tokens[{i}]", f"token {token} is outside [0, {vocab})")
    return DetokenizeResponse(prompt=preparer.tokenizer.decode(body.tokens, False))


def model_card(preparer: Preparer, model_id: str, router: ModelInfo, created: int) -> ModelCard:
    """``GET /v1/models/{model}``: the served model's card, or a 404 naming ``model``."""
    if model_id not in preparer.model_names:
        raise GatewayError(
            NOT_FOUND, f"The model `{model_id}` does not exist.", param="model",
            code="model_not_found",
        )  # fmt: skip
    name, root = preparer.model_names[0], preparer.model_names[-1]
    return ModelCard(id=name, created=created, root=root, max_model_len=router.max_model_len)
