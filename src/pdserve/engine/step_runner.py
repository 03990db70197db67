"""What computes the engine's steps: the ``StepRunner`` seam and the ``Compute`` it comes in.

The engine owns the policy (scheduler, block manager, prefix cache, hand-off bookkeeping); a
runner owns the device side: the KV pool and the forward pass. ``ModelRunner`` runs the real
model (``torch_compute``); ``pdserve.sim`` plugs in a runner that spends a modelled step
time instead, so everything above the runner is the same code in both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.config import EngineConfig
from pdserve.engine.faults import EngineFaults
from pdserve.engine.kv_payload import KVLayout
from pdserve.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from pdserve.engine.kv_arrays import KVArray
    from pdserve.engine.outputs import StepResult
    from pdserve.engine.scheduler import SchedulerOutput


class StepRunner(Protocol):
    """The device side of an engine: one scheduled step, and the KV pool's import/export."""

    def execute(
        self, out: SchedulerOutput, checkpoint: Callable[[], None] | None = None
    ) -> StepResult:
        """Run one scheduled step: the prompt chunks' and decodes' KV, and a token for every
        chunk that reaches its sequence's last token. ``checkpoint()`` between layers."""
        ...

    def read_layer(
        self, layer: int, block_table: list[int], num_tokens: int
    ) -> tuple[KVArray, KVArray]:
        """One layer's K, V of a sequence: ``[num_tokens, kv_heads, head_dim]`` copies."""
        ...

    def write_layer(
        self, layer: int, block_table: list[int], keys: KVArray, values: KVArray
    ) -> None:
        """Copy ``[num_tokens, kv_heads, head_dim]`` K/V into the slots of ``block_table``
        (numpy in the wire dtype when a transport received them: ``kv_arrays``)."""
        ...


@dataclass(frozen=True, slots=True)
class Compute:
    """A runner with the KV layout it keeps and the size of its pool."""

    runner: StepRunner
    layout: KVLayout
    num_blocks: int
    dtype: torch.dtype | None = None
    """The torch KV (and compute) dtype; None for a runner without torch (the sim)."""


ComputeFactory = Callable[[Path, ModelConfig, EngineConfig, int], Compute]
"""(checkpoint dir, its model config, engine config, max_model_len) -> the engine's compute."""


def torch_compute(faults: EngineFaults | None = None) -> ComputeFactory:
    """The real model: weights loaded from the checkpoint, the KV pool sized from
    ``num_kv_blocks`` or ``kv_cache_bytes``; ``faults`` are injected into its steps."""

    def build(model_dir: Path, mc: ModelConfig, config: EngineConfig, max_len: int) -> Compute:
        import torch  # the real model's path alone: the engine's module imports no torch

        from pdserve.engine.dtype import resolve_dtype
        from pdserve.engine.model_runner import ModelRunner
        from pdserve.models.loader import checkpoint_fingerprint, load_state_dict

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype_name = resolve_dtype(config.dtype, config.device)
        dtype: torch.dtype = getattr(torch, dtype_name)
        block_bytes = (
            2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize
        )
        num_blocks = config.num_kv_blocks or max(2, config.kv_cache_bytes // block_bytes)
        layout = KVLayout(
            model_fingerprint=checkpoint_fingerprint(model_dir),
            dtype=dtype_name,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=config.block_size,
        )
        runner = ModelRunner(
            mc,
            config,
            load_state_dict(model_dir, dtype=dtype),
            dtype=dtype,
            num_blocks=num_blocks,
            max_model_len=max_len,
            faults=faults,
        )
        return Compute(runner, layout, num_blocks, dtype)

    return build
