"""The OpenAI request bodies the gateway accepts, as pydantic models.

Fields follow OpenAI's Completions and Chat Completions APIs; ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens`` and ``return_token_ids`` are vLLM's extensions
(the ``openai`` client sends them through ``extra_body``). Unknown fields are ignored, as
OpenAI-compatible servers do. Parameters the engine cannot honour are refused with a 400 that
names them (``unsupported()``) rather than silently dropped.

Types are strict, as JSON has them: a boolean is not an integer (``max_tokens: true`` is
refused, not taken as 1), a string is not a number, an integer is a number (``temperature:
1``). A chat message's ``role`` is one of ``ROLES``.

Values the router checks against the model (temperature range, ``max_tokens`` against the
context length, token ids against the vocabulary) are left to it: its INVALID_ARGUMENT names
the field, and ``errors.openai_param`` maps that name back to the OpenAI parameter.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
"""Choices per prompt at most (``n``): each one is a request of its own in the cluster."""
MAX_CHOICES = 128
"""Choices per HTTP request at most (prompts of a batch times ``n``)."""
Role = Literal["system", "user", "assistant"]
"""Chat roles the gateway takes (it refuses tool calls, so there are no tool messages)."""
ROLES: tuple[str, ...] = get_args(Role)
MAX_LOGPROBS = 1
"""Only the sampled token's log-probability is known (the engine returns no alternatives), so
``logprobs``/``top_logprobs`` above 1 are refused."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    """Send a last chunk with ``usage`` (and no choices) before ``[DONE]``."""


class SamplingFields(_Body):
    """Parameters both endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    """Add ``token_ids`` (the generated ids) to every choice."""

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _unsupported(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.presence_penalty:
            out.append(("presence_penalty", "penalties are not supported; use 0"))
        if self.frequency_penalty:
            out.append(("frequency_penalty", "penalties are not supported; use 0"))
        if self.logit_bias:
            out.append(("logit_bias", "logit bias is not supported"))
        return out


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: int | None = None
    """Unset: the server's default (16, as OpenAI's)."""
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch: one text or token-id list each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [[int(x) for x in p if isinstance(x, int)]]
        return [x if isinstance(x, str) else list(x) for x in p if not isinstance(x, int)]

    def unsupported(self) -> list[tuple[str, str]]:
        """(parameter, why) of each parameter set to something the gateway cannot do."""
        out = self._unsupported()
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            out.append(("logprobs", f"at most {MAX_LOGPROBS}: only the sampled token's is known"))
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", "best_of is not supported; use n"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        return out


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); other part types are refused by
        ``ChatCompletionRequest.unsupported``."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """OpenAI's newer name for ``max_tokens``; unset (both): up to the model's context."""
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template."""

    def max_tokens_param(self) -> tuple[str, int | None]:
        """(the parameter's name as the caller spelt it, its value)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        """(parameter, why) of each parameter set to something the gateway cannot do."""
        out = self._unsupported()
        if self.top_logprobs is not None and self.top_logprobs > MAX_LOGPROBS:
            out.append(
                ("top_logprobs", f"at most {MAX_LOGPROBS}: only the sampled token's is known")
            )
        if self.tools:
            out.append(("tools", "tool calls are not supported"))
        if self.tool_choice not in (None, "none"):
            out.append(("tool_choice", "tool calls are not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only the text format is supported"))
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if part.type != "text":
                        out.append(
                            (f"messages[{i}].content[{j}].type", f"{part.type!r} parts are not "
                             "supported; only text")
                        )  # fmt: skip
        return out
