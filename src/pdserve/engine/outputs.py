"""What the engine hands back: per-step deltas, whole results, step shapes and stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from pdserve.errors import PdServeError, RequestFailedError
from pdserve.logprobs import PromptLogprobs, TopLogprobs

if TYPE_CHECKING:
    import torch


class FinishReason(StrEnum):
    STOP = "stop"
    """A stop token, the model's EOS or a stop string."""
    LENGTH = "length"
    """max_tokens reached."""
    ABORT = "abort"
    """Aborted by the caller."""


@dataclass(slots=True)
class RequestOutput:
    """One request's delta from one ``Engine.step()``.

    Tokens are appended in order; a request emits no more outputs after ``finished``.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text: str = ""
    """New text (never a split UTF-8 character; cut before a stop string)."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache or an imported KV payload."""
    logits: torch.Tensor | None = None
    """``[vocab]`` logits of the sampled step, only with ``EngineConfig.return_logits``."""
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """The alternatives at each new token (``SamplingParams.logprobs`` > 0), else empty."""
    prompt_logprobs: PromptLogprobs | None = None
    """On the output of the request's first token, when ``SamplingParams.prompt_logprobs``
    asked for them."""


@dataclass(slots=True)
class GenerationResult:
    """A finished request, as returned by ``Engine.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    num_cached_tokens: int = 0
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


class StepFailedError(PdServeError):
    """``Engine.step`` failed some requests; the engine is consistent and can step on.

    The failed requests are already aborted (their blocks freed, held KV included); the step's
    other requests progressed as usual and their outputs are in ``outputs``, to be delivered
    like those of a step that returned.
    """

    grpc_code = "INTERNAL"

    def __init__(
        self, failures: dict[str, RequestFailedError], outputs: list[RequestOutput]
    ) -> None:
        super().__init__(f"{len(failures)} request(s) failed in an engine step")
        self.failures = failures
        self.outputs = outputs


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for heartbeats and metrics."""

    num_blocks_total: int
    num_blocks_free: int
    block_size: int
    num_running: int
    num_waiting: int
    num_held: int
    num_waiting_imports: int
    """Of ``num_waiting``: handed-over KV waiting for a batch slot (decodes, not prompts)."""
    queued_tokens: int
    """Tokens still to prefill across waiting and running sequences."""
    num_preemptions: int
    prefix_cache_hits: int


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computed."""

    prefill_tokens: int = 0
    """Prompt tokens (prefill chunks, recomputes after preemption)."""
    decodes: int = 0
    """Sequences that decoded one token."""


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, tuple[int, float]]
    """request id -> (token, logprob) for every chunk that reached its last token."""
    failed: dict[str, str] = field(default_factory=dict)
    """request id -> why no token could be sampled (its logits were not finite); such a
    request is in no other field. Its forward pass ran: its KV is as valid as any."""
    logits: dict[str, torch.Tensor] | None = None
    """request id -> ``[vocab]`` float32 logits, when the config asks for them."""
    top: dict[str, TopLogprobs] = field(default_factory=dict)
    """request id -> the alternatives at its sampled token, for requests that ask for them."""
    prompt: dict[str, PromptLogprobs] = field(default_factory=dict)
    """request id -> the logprobs of the prompt positions this step computed (no
    ``token_ids``), for requests that ask for them."""
