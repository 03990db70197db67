"""One request inside the engine: its tokens, its KV blocks and where it is in its life.

Lifecycle:
  1. ``WAITING``: added, no KV computed (or preempted: KV dropped, to be recomputed).
  2. ``RUNNING``: admitted; each step computes a prompt chunk or one decode token.
  3. ``FINISHED_*``: stop/length/abort. Its blocks are freed, unless the request asked to hold
     its KV for export (a prefill worker's hand-off), in which case ``release_kv`` frees them.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.outputs import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.logprobs import PromptLogprobs

if TYPE_CHECKING:
    import torch

    from pdserve.engine.guided import GuideState
    from pdserve.engine.kv_arrays import KVArray


class LayerHook(Protocol):
    """Called once per layer when a prefill's KV of that layer is complete.

    ``keys``/``values``: ``[num_prompt_tokens, num_kv_heads, head_dim]``, gathered out of the
    paged cache for this call (``ModelRunner.read_layer``): the hook may keep them past the
    call (a transport writing them out on another thread); nothing writes into them again.
    """

    def __call__(self, layer: int, keys: KVArray, values: KVArray) -> None: ...


class SequenceStatus(IntEnum):
    """Ordered: everything above RUNNING is finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4

    @property
    def finished(self) -> bool:
        return self > SequenceStatus.RUNNING

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Sequence:
    """Token state and KV bookkeeping of one request. Holds no tensors."""

    __slots__ = (
        "arrival",
        "block_hashes",
        "block_table",
        "enqueued_at",
        "generator",
        "guide",
        "hold_kv",
        "layer_hook",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "num_registered_blocks",
        "output_logprobs",
        "params",
        "prompt_logprobs",
        "request_id",
        "seed",
        "status",
        "tenant",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival: int,
        hold_kv: bool = False,
        layer_hook: LayerHook | None = None,
        tenant: str = "",
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.hold_kv = hold_kv
        self.layer_hook = layer_hook
        self.tenant = tenant
        """The prefix-cache namespace: it salts the block hashes (``block_manager``)."""
        self.status = SequenceStatus.WAITING
        self.enqueued_at = 0.0
        """``time.monotonic()`` when the scheduler first queued it (for waiting-queue aging)."""
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (prefix hits included)."""
        self.num_cached_tokens = 0
        """Prompt tokens that came from the prefix cache or an import, not computed here."""
        self.block_hashes: list[bytes] = []
        """Chained hashes of the leading full, computed blocks (they depend on tokens only, so
        they survive preemption)."""
        self.num_registered_blocks = 0
        """Leading blocks of ``block_table`` already published to the prefix cache."""
        self.output_logprobs: list[float] = []
        self.prompt_logprobs: PromptLogprobs | None = (
            PromptLogprobs(list(prompt_token_ids)) if params.prompt_logprobs is not None else None
        )
        """The prompt's logprobs so far (``params.prompt_logprobs``), filled in as its chunks
        are computed."""
        self.generator: torch.Generator | None = None
        """A sampled sequence's torch generator, made by the sampler at its first draw."""
        self.seed = 0
        """Sampling seed; output token ``i`` is drawn from a generator seeded by (seed, i), so
        the draw does not depend on batch, preemption or which engine samples it."""
        self.guide: GuideState | None = None
        """The grammar matcher of a structured-output request, past every output token."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and some are still to compute: the prompt is computed
        from its start, not taken from the prefix cache."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl.logprobs) < self.num_prompt_tokens - 1

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:  # no token ids: prompts stay out of logs
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
