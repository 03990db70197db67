"""PrefillWorker: compute a prompt's KV and first token, and hand the KV over as it is made.

Per request: check it against the model (the full ``max_tokens`` included, so that a request
the decode side would refuse fails here, before any compute); plan and open its hand-off
(``handoff.PrefillConnector``); optionally import the prompt's leading blocks from the KV store
into the engine's prefix cache (``prefix.PrefixReuse``); run the prompt with ``max_tokens=1``
and the hand-off's layer hook (each layer leaves while the engine computes the next ones);
then, unless the first token ends the request (a stop, ``max_tokens == 1``, the model's
length), hand over and answer with where the KV is, or ``recompute`` when the hand-off
failed. Every path that does not hand the KV over discards it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.backends import EngineBackend, Prefilled
from pdserve.convert import check_sampling_against, check_token_ids
from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.handoff import HandoffRoute, Outgoing, PrefillConnector
from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.prefix.store import PrefixReuse
from pdserve.timing import RequestTiming, Timing
from pdserve.transfer.base import HandoffRecord, KVLocation

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

logger = logging.getLogger(__name__)


def check_request(engine: EngineBackend, request: EngineRequest) -> None:
    """Raise ``InvalidArgumentError`` naming the (proto) field the engine would refuse."""
    request_id, prompt_ids, params = request.request_id, request.prompt_ids, request.params
    if not request_id:
        raise InvalidArgumentError("request_id", "must not be empty")
    check_token_ids(prompt_ids, vocab_size=engine.vocab_size, field="prompt_token_ids")
    if len(prompt_ids) >= engine.max_model_len:
        raise InvalidArgumentError(
            "prompt_token_ids",
            f"{len(prompt_ids)} tokens; the model's maximum length is {engine.max_model_len}",
        )
    check_sampling_against(
        params,
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        prompt_len=len(prompt_ids),
    )


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The first token, where its KV went, and where the time went."""

    first_token_id: int
    first_logprob: float
    kv: KVLocation | None
    """None when ``finish_reason`` is set (nothing left to decode)."""
    finish_reason: FinishReason | None
    timing: Timing
    """The figures (``RequestTiming.prefill``): queue, compute (``prefill_ms``), the part of
    the hand-off not hidden behind the compute (end of compute to commit), bytes sent."""
    num_cached_tokens: int
    transfer: HandoffRecord | None = None
    """The sender's measurements; None when nothing was sent."""
    stamps: RequestTiming | None = None
    """The engine-thread stamps the figures were derived from (the stage spans)."""
    first_top_logprobs: TopLogprobs | None = None
    """The first token's alternatives (``SamplingParams.logprobs`` > 0)."""
    prompt_logprobs: PromptLogprobs | None = None
    """``SamplingParams.prompt_logprobs`` set: the prompt's logprobs."""


def finish_at_first(
    out: RequestOutput, params: SamplingParams, prompt_len: int, max_model_len: int
) -> FinishReason | None:
    """Whether the first token ends the request under its real ``max_tokens``."""
    if out.finish_reason is FinishReason.STOP:
        return FinishReason.STOP
    if params.max_tokens <= 1 or prompt_len + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None


class PrefillWorker:
    """Runs prefills on one engine backend and hands their KV over through its ``connector``
    (see the module docstring), which it owns."""

    def __init__(
        self,
        engine: EngineBackend,
        connector: PrefillConnector,
        *,
        prefix: PrefixReuse | None = None,
    ) -> None:
        self.engine = engine
        self.connector = connector
        self.prefix = prefix

    async def close(self) -> None:
        """Wait for prefix publishing; close the connector."""
        if self.prefix is not None:
            await self.prefix.close()
        await self.connector.close()

    async def prefill(
        self, request: EngineRequest, route: HandoffRoute | None = None
    ) -> PrefillResult:
        """Prefill ``request`` and hand its KV over as ``route`` says (None: no decode worker
        known, the policy's transport; see the module docstring)."""
        params, prompt_ids = request.params, request.prompt_ids
        check_request(self.engine, request)
        plan = await self.connector.plan(request, route or HandoffRoute())
        async with self.connector.open(plan) as out:
            timing = RequestTiming()
            done, compute_end_ns = await self._run(request, timing, out)
            last = done.output
            reason = finish_at_first(last, params, len(prompt_ids), self.engine.max_model_len)
            sent = None if reason is not None else await out.hand_over(compute_end_ns, done.native)
        record = sent.record if sent is not None else None
        return PrefillResult(
            first_token_id=last.new_token_ids[0],
            first_logprob=last.new_logprobs[0],
            kv=sent.location if sent is not None else None,
            finish_reason=reason,
            timing=timing.prefill(
                transfer_ms=record.exposed_ms if record else 0.0,
                transfer_bytes=sent.num_bytes if sent is not None else 0,
            ),
            num_cached_tokens=last.num_cached_tokens,
            transfer=record,
            stamps=timing,
            first_top_logprobs=next(iter(last.new_top_logprobs), None),
            prompt_logprobs=last.prompt_logprobs,
        )

    async def _run(
        self, request: EngineRequest, timing: RequestTiming, out: Outgoing
    ) -> tuple[Prefilled, int]:
        """Prefill with the hooks; what the engine answered and when the compute ended."""
        request_id, prompt_ids, tenant = request.request_id, request.prompt_ids, request.tenant
        publisher = None
        # The KV store's prefix chunks enter an engine that takes KV as bytes only.
        if self.prefix is not None and self.engine.features.kv_payload:
            found = await self.prefix.seed(self.engine, request_id, prompt_ids, tenant)
            publisher = self.prefix.publisher(prompt_ids, tenant, first=found)
        hooks = [h for h in (out.layer_hook, publisher) if h is not None]

        def hook(layer: int, keys: KVArray, values: KVArray) -> None:
            for h in hooks:  # each one never raises
                h(layer, keys, values)

        done = await self.engine.prefill(
            request,
            handoff=out.engine_handoff,
            timing=timing,
            layer_hook=hook if hooks else None,
        )
        compute_end_ns = time.monotonic_ns()
        if not done.output.new_token_ids:
            raise KVTransferError(f"prefill of {request_id!r} produced no first token")
        if publisher is not None and self.prefix is not None:
            self.prefix.publish(publisher)
        return done, compute_end_ns
