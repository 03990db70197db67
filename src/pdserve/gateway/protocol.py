"""The OpenAI request bodies the gateway accepts, as pydantic models.

Every field of OpenAI's Completions and Chat Completions request schemas, and of vLLM's
extensions to them (the ``openai`` client sends those in ``extra_body``), is declared here,
so that each is either honoured or refused with a 400 naming it (``fields.refusals``); a
field neither schema has is refused too, unless the gateway runs with
``--allow-unknown-fields`` (``fields.unknown_fields``). ``docs/http-api.md`` lists what each
field does.

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
Role = Literal["system", "user", "assistant", "tool", "developer"]
"""Chat roles the gateway takes; the chat template renders each as it knows it."""
ROLES: tuple[str, ...] = get_args(Role)


class Body(BaseModel):
    """Every request object: strict JSON types; keys outside the schema are kept in
    ``model_extra`` for ``fields.unknown_fields`` to refuse or let pass."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Body):
    include_usage: bool = False
    """Send a last chunk with ``usage`` (and no choices) before ``[DONE]``."""
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries its choice's usage so far."""
    include_obfuscation: bool = False
    """OpenAI's: random padding on each chunk (refused)."""


class SamplingFields(Body):
    """Parameters both endpoints share: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """Token ids as JSON object keys (strings), as OpenAI sends them."""
    user: str | None = None
    """An identifier of the end user, for the caller's records: it changes nothing."""
    # vLLM's sampling parameters
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    """Keep the last this many prompt tokens."""
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0)
    bad_words: list[str] | None = None
    # vLLM's other extensions
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    priority: int = 0
    request_id: str | None = Field(default=None, min_length=1, max_length=128)
    """The id of the response (``cmpl-{request_id}``) and, with a choice suffix, of its
    requests in the cluster."""
    logits_processors: Any = None
    return_tokens_as_token_ids: bool = False
    """Tokens in logprobs as ``token_id:{id}``."""
    return_token_ids: bool = False
    """Add ``token_ids`` (the generated ids) to every choice."""
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: int | None = None
    """Unset: the server's default (16, as OpenAI's)."""
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    # vLLM's
    prompt_embeds: Any = None
    add_special_tokens: bool = True
    """Tokenize a text prompt with the model's BOS."""

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch: one text or token-id list each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [[int(x) for x in p if isinstance(x, int)]]
        return [x if isinstance(x, str) else list(x) for x in p if not isinstance(x, int)]


class TextPart(Body):
    type: str
    text: str | None = None


class CalledFunction(Body):
    name: str
    arguments: str | dict[str, Any]
    """A JSON object's text, as OpenAI sends it, or the object (Hugging Face's convention);
    templates are given the object."""


class MessageToolCall(Body):
    """A call of an earlier ``assistant`` message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    """A ``tool`` message's: the call it answers (the chat template renders it)."""
    tool_calls: list[MessageToolCall] | None = None
    """An ``assistant`` message's earlier calls (the chat template renders them)."""
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None

    def text(self) -> str:
        """The content as one string (text parts joined); other part types are refused by
        ``fields.refusals``."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class FunctionDefinition(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of type object; unset or ``{}``: no parameters."""
    strict: bool | None = None
    """OpenAI's: enforce the schema. A guided call (``tool_choice`` ``required`` or a name)
    always is; an ``auto`` one never is."""


class ToolDefinition(Body):
    """A function the model may call (``tools[i]``)."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """OpenAI's newer name for ``max_tokens``; unset (both): up to the model's context."""
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    """Unset: ``auto`` with tools, ``none`` without."""
    parallel_tool_calls: bool | None = None
    """Unset: true (any number of calls); false: one at most."""
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    metadata: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    prompt_cache_key: str | None = None
    """A hint for OpenAI's cache routing: pdserve's prefix caches match prompts themselves,
    so it changes nothing."""
    reasoning_effort: Any = None
    safety_identifier: str | None = None
    """Like ``user``: for the caller's records, it changes nothing."""
    service_tier: str | None = None
    store: bool | None = None
    verbosity: Any = None
    web_search_options: Any = None
    # vLLM's
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Render the last (assistant) message open-ended, for the model to continue it."""
    add_special_tokens: bool = False
    """Add the model's BOS before the chat template's text (which writes its own)."""
    documents: list[dict[str, str]] | None = None
    """Passed to the chat template as ``documents`` (retrieval-augmented templates)."""
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template."""
    mm_processor_kwargs: Any = None
    include_reasoning: bool = True
    """No reasoning parser runs: every token is content either way."""

    def max_tokens_param(self) -> tuple[str, int | None]:
        """(the parameter's name as the caller spelt it, its value)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens
