"""What the SDK returns: streamed deltas and whole completions (read from the Router's
messages by ``pdserve.client.convert``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.timing import Timing


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens served from a worker's prefix cache."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a router serves (``Client.model_info``)."""

    max_model_len: int
    """Tokens a sequence may hold, prompt and output together."""
    max_prompt_tokens: int
    """Token ids a prompt may have."""
    tenant: str
    """The caller's tenant as the router sees it (its key's, where the router has keys)."""


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed piece: new tokens and text; the last one carries finish_reason and totals."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    """None until the last delta: then "stop", "length", "abort" or "error"."""
    usage: Usage | None = None
    timing: Timing | None = None
    request_id: str = ""
    """Set on the first delta."""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """The alternatives at each of ``token_ids`` (``logprobs=k`` asked for them), else empty."""
    prompt_logprobs: PromptLogprobs | None = None
    """On the first delta, when ``prompt_logprobs=k`` asked for them."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Completion:
    """A finished request."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    usage: Usage | None
    timing: Timing | None
    request_id: str = ""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """The alternatives at each of ``token_ids`` (``logprobs=k`` asked for them), else empty."""
    prompt_logprobs: PromptLogprobs | None = None
    """``prompt_logprobs=k`` asked for them: the prompt's logprobs."""


@dataclass(slots=True)
class CompletionBuilder:
    """Accumulates deltas into a Completion."""

    request_id: str = ""
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.request_id = self.request_id or delta.request_id
        self.text_parts.append(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.top_logprobs += delta.top_logprobs
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        self.last = delta

    @property
    def started(self) -> bool:
        """True once any token has arrived (after that a request is never retried)."""
        return bool(self.token_ids)

    def completion(self) -> Completion:
        last = self.last
        return Completion(
            text="".join(self.text_parts),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason=last.finish_reason if last else None,
            usage=last.usage if last else None,
            timing=last.timing if last else None,
            request_id=self.request_id,
            top_logprobs=list(self.top_logprobs),
            prompt_logprobs=self.prompt_logprobs,
        )
