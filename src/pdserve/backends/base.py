"""The seam between the workers and the engine that computes: ``EngineBackend``.

What the workers ask of an engine, whatever computes:

* a colocated (mixed) worker: ``generate`` a whole request, streaming its tokens;
* a prefill worker: ``prefill`` the prompt to its first token and say what becomes of the KV
  (``Handoff``): freed at once (a layer hook copied it out while it was computed), held for
  ``export_kv`` (pdserve's transports), or kept by the engine for its own transfer (``NATIVE``:
  the result carries a ``NativeKV`` handle that travels in the ``KVHandle``);
* a decode worker: ``decode`` the tokens after the prefill's first token from the handed-over
  KV (a ``KVPayload`` for pdserve's transports, a ``NativeKV`` for the engine's own, or nothing:
  the backend computes the prompt itself first);
* both: ``capacity`` for heartbeats (KV blocks, queued tokens, running requests, the admitted
  reservation tags), ``layout``/``fingerprint`` (what must match between a KV writer and reader),
  the model's limits, ``abort`` and ``close``.

``features`` says which of these a backend supports; a call a backend cannot serve fails with
``InvalidArgumentError`` naming the field that asked for it (``transport``, ``kv.location``),
never silently. Streams (``generate``, ``decode``) raise their errors at the first
``__anext__``; closing one before its last output aborts the request and frees its KV.

Implementations: ``backends.pytorch.TorchBackend`` (pdserve's own engine; also the simulated
one of ``pdserve.sim``, whose steps take modelled time) and
``backends.tensorrt_llm.TensorRTLLMBackend`` (TensorRT-LLM's LLM API, imported lazily).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pdserve.engine.step_meter import StepModel
from pdserve.transfer.handle import NativeKV  # the handle travels in ``KVLocation``

if TYPE_CHECKING:
    from pdserve.engine.gate import ComputeGate
    from pdserve.engine.kv_payload import KVLayout, KVPayload
    from pdserve.engine.outputs import RequestOutput
    from pdserve.engine.request import EngineRequest
    from pdserve.engine.sequence import LayerHook
    from pdserve.timing import RequestTiming

TORCH = "torch"
TENSORRT_LLM = "tensorrt-llm"
SIM = "sim"
BACKEND_NAMES = (TORCH, TENSORRT_LLM, SIM)
"""The values of ``--backend``."""


class Handoff(StrEnum):
    """What becomes of a prefill's KV once its first token is out."""

    RELEASE = "release"
    """Freed at once: a layer hook copied it out as it was computed, or nobody needs it."""
    HOLD = "hold"
    """Kept in the engine's blocks until ``export_kv`` or ``abort``."""
    NATIVE = "native"
    """Kept by the engine for its own transfer; ``Prefilled.native`` names it."""


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What ``prefill`` returns."""

    output: RequestOutput
    """The request's finished output: the first token (``new_token_ids[0]``), its logprob,
    the finish reason under ``max_tokens=1`` and the cached prompt tokens."""
    native: NativeKV | None = None
    """With ``Handoff.NATIVE``: the handle of the KV the engine keeps for its transfer. None
    when the first token ended the request (a stop token): nothing is left to hand over."""


@dataclass(frozen=True, slots=True)
class BackendFeatures:
    """What a backend can do beyond generate, prefill and decode."""

    kv_payload: bool
    """``Handoff.HOLD``, ``export_kv`` and ``decode`` from a ``KVPayload``: the KV leaves and
    enters the engine as bytes, so pdserve's transports (store, direct, shm) can move it."""
    layer_hook: bool
    """``prefill`` calls a layer hook as each layer's KV is computed (layer-wise hand-off)."""
    prefix_cache: bool
    """``cached_prefix_blocks`` and ``export_cached_prefix`` answer from the engine's prefix
    cache (decode-side prefix reuse); without it they answer 0 and None."""
    native_kv: bool
    """``Handoff.NATIVE`` and ``decode`` from a ``NativeKV``: the engine moves KV itself."""


@dataclass(frozen=True, slots=True)
class Capacity:
    """The load and health a heartbeat and the metrics report, readable from any thread
    without waiting for the engine."""

    blocks_total: int
    blocks_free: int
    block_size: int
    """Tokens per KV block."""
    queued_tokens: int
    """Prompt tokens still to compute."""
    running: int
    """Requests being computed."""
    waiting: int
    """Requests admitted but not yet computing."""
    waiting_decodes: int = 0
    """Of ``waiting``: handed-over requests whose KV waits for a batch slot."""
    tags: tuple[str, ...] = ()
    """Tags (scheduler reservation ids) of the requests the engine holds."""
    failed_steps: int = 0
    """Engine steps that failed some of their requests (the engine went on)."""
    failed_requests: int = 0
    """Requests the engine failed (a step's failure, or the engine's own error)."""
    failed: bool = False
    """The engine failed for good: it takes no more requests."""
    held: int = 0
    """Finished requests whose KV the engine still holds (for a hand-off or a prefix)."""
    steps: StepModel = field(default_factory=StepModel)
    """The live step-time model (nothing measured: zeros, which the cost model's priors fill)."""


@runtime_checkable
class EngineBackend(Protocol):
    """An engine as the workers use it (see the module docstring)."""

    @property
    def name(self) -> str:
        """One of ``BACKEND_NAMES``."""
        ...

    @property
    def features(self) -> BackendFeatures: ...

    @property
    def layout(self) -> KVLayout:
        """The KV cache's shape: layers, heads, dtype, block size, model fingerprint."""
        ...

    @property
    def fingerprint(self) -> str:
        """What must be equal between a KV writer and its reader (heartbeats, handles)."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's KV over all layers: what a hand-off moves per prompt token
        (for a simulated engine, the modelled model's, not its small stand-in payload's)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens at most."""
        ...

    @property
    def max_num_batched_tokens(self) -> int:
        """Tokens one engine step computes at most."""
        ...

    @property
    def max_num_seqs(self) -> int:
        """Sequences one engine step carries at most (0: the engine does not say)."""
        ...

    @property
    def gate(self) -> ComputeGate:
        """How the engine shares its device with the host's other engines (``UNGATED``: it
        does not take part)."""
        ...

    async def start(self) -> None:
        """Begin serving; idempotent. Call from the event loop the worker serves on."""
        ...

    def generate(
        self,
        request: EngineRequest,
        *,
        timing: RequestTiming | None = None,
        coalesce: bool = False,
        generated: Sequence[int] = (),
    ) -> AsyncGenerator[RequestOutput, None]:
        """A whole request: the outputs from the first token on, the last one ``finished``.

        The request's ``tenant`` separates tenants in prefix caches; its ``reservation_id`` is
        listed in ``capacity().tags`` while it is admitted; ``timing`` is filled in as it runs;
        ``coalesce`` merges outputs already waiting for a slow consumer into one.
        ``generated``: output tokens another engine drew before the request migrated here
        (they count in ``max_tokens``); the outputs are the tokens after them.
        """
        ...

    async def prefill(
        self,
        request: EngineRequest,
        *,
        handoff: Handoff,
        timing: RequestTiming | None = None,
        layer_hook: LayerHook | None = None,
    ) -> Prefilled:
        """Compute the prompt and its first token (the request's ``params`` with
        ``max_tokens=1``).

        With ``Handoff.HOLD`` the caller must ``export_kv`` or ``abort`` afterwards;
        cancelling the call aborts the request.
        """
        ...

    def decode(
        self,
        request: EngineRequest,
        first_token: tuple[int, float],
        kv: KVPayload | NativeKV | None,
        *,
        timing: RequestTiming | None = None,
        coalesce: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The tokens after ``first_token`` (token, logprob), from the prompt's KV.

        ``kv`` None: nothing was handed over; the backend computes the prompt first.
        ``request.params.max_tokens`` counts the first token, as in a whole request.
        """
        ...

    async def export_kv(self, request_id: str) -> KVPayload:
        """Copy a held prefill's KV out and free its blocks (``features.kv_payload``)."""
        ...

    def abort(self, request_id: str) -> None:
        """Free a held prefill's KV (``Handoff.HOLD``), or stop a request whose stream nobody
        reads; nothing if it is unknown. A stream being read is stopped by closing it."""
        ...

    def hand_back(self, why: str) -> None:
        """End every running stream (``generate``, ``decode``) with
        ``HandedBackError(why)`` (UNAVAILABLE) and free its KV, so that the router continues each
        request on another worker (a migration, ``router.failover``); held KV stays. A
        mixed worker leaving decode duty calls it instead of draining (``worker.duty``)."""
        ...

    async def cached_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of these chained hashes the prefix cache holds (a hint)."""
        ...

    async def export_cached_prefix(self, block_hashes: Sequence[bytes]) -> KVPayload | None:
        """The cached KV of these leading blocks; None when any of them is gone."""
        ...

    def capacity(self) -> Capacity:
        """The load as of the engine's latest report (no waiting)."""
        ...

    async def failed(self) -> BaseException:
        """Wait until the engine has failed for good; the failure."""
        ...

    async def close(self) -> None:
        """Abort everything and release the engine; idempotent."""
        ...


async def recompute_kv(engine: EngineBackend, request: EngineRequest) -> KVPayload:
    """The KV of the request's prompt, computed on ``engine`` as a transfer would have
    delivered it (a prefill held, exported, its blocks freed; seeded sampling draws by output
    position, so the tokens after it are a transfer's). For a backend with ``kv_payload``."""
    held = False
    try:
        await engine.prefill(request, handoff=Handoff.HOLD)
        held = True
        payload = await engine.export_kv(request.request_id)
        held = False
        return payload
    finally:
        if held:
            engine.abort(request.request_id)  # releases the held blocks


async def refuse(error: BaseException) -> AsyncGenerator[RequestOutput, None]:
    """A stream that raises ``error`` at its first ``__anext__`` (a call a backend refuses)."""
    raise error
    yield  # pragma: no cover - makes this an async generator
