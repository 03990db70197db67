"""``TorchBackend``: pdserve's own PyTorch engine (``AsyncEngine``) as an ``EngineBackend``.

A thin adapter: every call maps onto one ``AsyncEngine`` call, so a worker on this backend
behaves exactly as one driving the ``AsyncEngine`` directly. It supports every feature:
KV leaves and enters as ``KVPayload`` bytes (pdserve's transports), layer hooks during the
prefill, and the prefix cache; it has no native KV transfer.

A structured-output request's guide is compiled (or found in the engine's cache) on a thread
of the event loop's executor before the request reaches the engine, so that neither the
engine thread nor the event loop waits for a compile, and a guide that does not compile is
refused before admission, naming its request field (``sampling.guided_json``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

from pdserve.backends.base import (
    TORCH,
    BackendFeatures,
    Capacity,
    Handoff,
    NativeKV,
    Prefilled,
    recompute_kv,
    refuse,
)
from pdserve.engine.faults import EngineFaults
from pdserve.engine.gate import ComputeGate
from pdserve.engine.kv_payload import KVLayout, KVPayload, kv_fingerprint
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import LayerHook
from pdserve.engine_loop.async_engine import AsyncEngine
from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.timing import RequestTiming

FEATURES = BackendFeatures(kv_payload=True, layer_hook=True, prefix_cache=True, native_kv=False)

NO_NATIVE = (
    "the torch backend has no native KV transfer: its KV moves through pdserve's transports "
    "(store, direct, shm) or is recomputed"
)


class TorchBackend:
    """An ``AsyncEngine`` behind the ``EngineBackend`` protocol (see the module docstring)."""

    features = FEATURES

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        name: str = TORCH,
        kv_bytes_per_token: int | None = None,
        import_delay: Callable[[KVPayload], float] | None = None,
    ) -> None:
        """``name``, ``kv_bytes_per_token`` and ``import_delay`` are for an engine whose steps
        are simulated (``pdserve.sim``): its backend name, the modelled model's KV bytes per
        token (default: the layout's), and the seconds a modelled link takes to bring a
        handed-over payload, spent before the decode starts."""
        self.engine = engine
        self.name = name
        self.layout: KVLayout = engine.layout
        self.kv_bytes_per_token: int = kv_bytes_per_token or (
            engine.layout.num_layers * engine.layout.bytes_per_token_per_layer
        )
        self._import_delay = import_delay
        self.fingerprint: str = kv_fingerprint(engine.layout)
        self.vocab_size: int = engine.vocab_size
        self.max_model_len: int = engine.max_model_len
        self.max_num_batched_tokens: int = engine.max_num_batched_tokens
        self.max_num_seqs: int = engine.max_num_seqs

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        batch_window_ms: float = 0.0,
        gate: ComputeGate | None = None,
        faults: EngineFaults | None = None,
        **config: Any,
    ) -> TorchBackend:
        """Load a checkpoint (blocking); ``config`` holds ``EngineConfig`` fields, ``gate``
        how the engine shares the host's cores, ``faults`` failures to inject (fault tests
        only). Call ``start()`` next."""
        engine = AsyncEngine.from_pretrained(
            model_dir, batch_window_ms=batch_window_ms, faults=faults, **config
        )
        if gate is not None:
            engine.engine.gate = gate
        return cls(engine)

    @property
    def gate(self) -> ComputeGate:
        return self.engine.gate

    async def start(self) -> None:
        if not self.engine.running:
            self.engine.start()

    async def compile_guide(self, params: SamplingParams) -> None:
        """Compile ``params``' guide into the engine's cache, off the engine thread;
        ``InvalidArgumentError`` naming its field under ``sampling.`` when it does not."""
        if params.guide is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self.engine.guides.compile, params.guide
            )
        except InvalidArgumentError as err:
            message = str(err).removeprefix(f"{err.field}: ")
            raise InvalidArgumentError(f"sampling.{err.field}", message) from None

    async def _compiled(
        self, params: SamplingParams, stream: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[RequestOutput, None]:
        """``stream`` (not started yet) once ``params``' guide is compiled."""
        async with aclosing(stream):
            await self.compile_guide(params)
            async for output in stream:
                yield output

    def generate(
        self,
        request: EngineRequest,
        *,
        timing: RequestTiming | None = None,
        coalesce: bool = False,
        generated: Sequence[int] = (),
    ) -> AsyncGenerator[RequestOutput, None]:
        stream = self.engine.generate(
            request, timing=timing, coalesce=coalesce, generated=generated
        )
        return stream if request.params.guide is None else self._compiled(request.params, stream)

    async def prefill(
        self,
        request: EngineRequest,
        *,
        handoff: Handoff,
        timing: RequestTiming | None = None,
        layer_hook: LayerHook | None = None,
    ) -> Prefilled:
        if handoff is Handoff.NATIVE:
            raise InvalidArgumentError("transport", NO_NATIVE)
        await self.compile_guide(request.params)
        last: RequestOutput | None = None
        stream = self.engine.generate(
            dataclasses.replace(request, params=request.params.first_token_only()),
            hold_kv=handoff is Handoff.HOLD,
            timing=timing,
            layer_hook=layer_hook,
        )
        async with aclosing(stream):
            async for output in stream:
                last = output
        if last is None:  # the engine always ends a stream with a finished output or raises
            raise WorkerUnavailableError(
                f"the prefill of {request.request_id!r} ended without output"
            )
        return Prefilled(last)

    def decode(
        self,
        request: EngineRequest,
        first_token: tuple[int, float],
        kv: KVPayload | NativeKV | None,
        *,
        timing: RequestTiming | None = None,
        coalesce: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        stream = self._decode(request, first_token, kv, timing, coalesce)
        return stream if request.params.guide is None else self._compiled(request.params, stream)

    def _decode(
        self,
        request: EngineRequest,
        first_token: tuple[int, float],
        kv: KVPayload | NativeKV | None,
        timing: RequestTiming | None,
        coalesce: bool,
    ) -> AsyncGenerator[RequestOutput, None]:
        if isinstance(kv, NativeKV):
            return refuse(InvalidArgumentError("kv.native", NO_NATIVE))
        if kv is None:
            return self._recompute_then_decode(request, first_token, timing, coalesce)
        stream = functools.partial(self._from_payload, request, first_token, kv, timing, coalesce)
        if self._import_delay is not None:
            return self._after(self._import_delay(kv), stream)
        return stream()

    def _from_payload(
        self,
        request: EngineRequest,
        first_token: tuple[int, float],
        payload: KVPayload,
        timing: RequestTiming | None,
        coalesce: bool,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The decode after ``first_token`` from the prompt's KV in ``payload`` (handed over,
        or computed here)."""
        return self.engine.generate(
            request, kv=payload, first_token=first_token, timing=timing, coalesce=coalesce
        )

    @staticmethod
    async def _after(
        seconds: float, stream: Callable[[], AsyncGenerator[RequestOutput, None]]
    ) -> AsyncGenerator[RequestOutput, None]:
        """``stream()``'s outputs, begun ``seconds`` from now (a modelled transfer)."""
        await asyncio.sleep(seconds)  # the modelled link's time, not synchronisation
        inner = stream()
        async with aclosing(inner):
            async for output in inner:
                yield output

    async def _recompute_then_decode(
        self,
        request: EngineRequest,
        first_token: tuple[int, float],
        timing: RequestTiming | None,
        coalesce: bool,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Compute the prompt's KV here (``recompute_kv``) and decode from it as if it had
        been handed over: the tokens are exactly a transfer's (the given first token is
        kept)."""
        payload = await recompute_kv(self, request)
        stream = self._from_payload(request, first_token, payload, timing, coalesce)
        async with aclosing(stream):
            async for output in stream:
                yield output

    async def export_kv(self, request_id: str) -> KVPayload:
        return await self.engine.export_and_release(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def hand_back(self, why: str) -> None:
        self.engine.hand_back(why)

    async def cached_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        hashes = list(block_hashes)
        return await self.engine.call(lambda e: e.cached_prefix_blocks(hashes))

    async def export_cached_prefix(self, block_hashes: Sequence[bytes]) -> KVPayload | None:
        hashes = list(block_hashes)
        return await self.engine.call(lambda e: e.export_cached_prefix(hashes))

    def capacity(self) -> Capacity:
        snapshot = self.engine.snapshot()
        stats = snapshot.stats
        return Capacity(
            blocks_total=stats.num_blocks_total,
            blocks_free=stats.num_blocks_free,
            block_size=stats.block_size,
            queued_tokens=stats.queued_tokens,
            running=stats.num_running,
            waiting=stats.num_waiting,
            waiting_decodes=stats.num_waiting_imports,
            tags=snapshot.tags,
            failed_steps=snapshot.failed_steps,
            failed_requests=snapshot.failed_requests,
            failed=snapshot.failed,
            held=stats.num_held,
            steps=snapshot.steps,
        )

    async def failed(self) -> BaseException:
        return await self.engine.failed()

    async def close(self) -> None:
        await self.engine.close()


def torch_threads() -> int:
    """The intra-op threads torch uses by default in this process."""
    import torch  # the torch engine's path alone: a sim worker never calls this

    return torch.get_num_threads()


def set_torch_threads(n: int) -> None:
    """Set the intra-op threads of the calling thread's torch ops (the engine thread's: an
    OpenMP thread count is per thread)."""
    import torch

    torch.set_num_threads(n)
