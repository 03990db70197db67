"""Measure this machine's real engine step times and fit a ``Fitted`` step-time profile.

The sim backend prices each step with a ``TimingModel``; a ``Fitted`` one is linear in five
step features (``fitted.features``). ``calibrate`` produces one for the torch engine on the
CPU it runs on: it loads a checkpoint into pdserve's real engine (``load_engine``), records
the steps of a ``CalibrationPlan`` (``recording.record_plan``) on every thread and on each
share of a host lease's split, and fits each (``fitted.fit``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.compute.lease import interactive_threads
from pdserve.compute.omp import OMP_WAIT_POLICY
from pdserve.cpuinfo import cpu_model, isa_flags
from pdserve.errors import InvalidArgumentError
from pdserve.sim.fitted import Fitted, fit
from pdserve.sim.recording import STEPS_FLAG, CalibrationPlan, Progress, Sample, record_plan
from pdserve.sim.shapes import ModelShape

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine


def describe_device(threads: int, dtype: str) -> str:
    """One line naming what was measured: CPU, logical CPUs, ISA, torch threads, dtype and
    the OpenMP wait policy (``compute.omp``: it changes a small model's step times)."""
    isa = " ".join(isa_flags()) or "no avx2"
    wait = os.environ.get(OMP_WAIT_POLICY, "unset")
    return (
        f"{cpu_model()} ({os.cpu_count()} CPUs, {isa}), torch {threads} threads, {dtype}, "
        f"{OMP_WAIT_POLICY}={wait}"
    )


Beside = Callable[[int], AbstractContextManager[object]]
"""Given a thread count, a context in which that many threads of the host are busy with the
engine's work (``sim.companion.beside``): what the other share of a split runs."""


def load_engine(
    model_dir: Path, plan: CalibrationPlan, *, dtype: str = "auto", threads: int | None = None
) -> Engine:
    """The torch engine on ``model_dir`` sized for ``plan`` (capped to the model's length): a
    token budget holding its longest prompt in one step, a KV pool holding its largest decode
    batch, prefix caching on. ``dtype`` and ``threads`` are ``EngineConfig.dtype`` and
    ``num_threads`` (the latter sets torch's process-wide thread count)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.models.config import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    limit = min(mc.max_position_embeddings, mc.sliding_window or mc.max_position_embeddings)
    plan = plan.capped(limit)
    defaults = EngineConfig()
    max_seqs = max(defaults.max_num_seqs, *plan.decode_batches)
    budget = max(plan.longest_chunk, max_seqs)
    return Engine.from_pretrained(
        model_dir,
        dtype=dtype,
        num_threads=threads,
        enable_prefix_caching=True,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        num_kv_blocks=plan.kv_blocks(defaults.block_size, budget),
    )


def calibrate(
    model_dir: str | Path,
    plan: CalibrationPlan | None = None,
    *,
    dtype: str = "auto",
    threads: int | None = None,
    split: bool = True,
    beside: Beside | None = None,
    progress: Progress | None = None,
) -> Fitted:
    """Load ``model_dir`` into the torch engine (``load_engine``), run ``plan`` and fit a
    ``Fitted`` profile.

    With ``split`` the plan runs again on each share of the threads that a host lease's
    split gives (``split_shares``), fit into the profile's ``shares``: engines sharing a host
    step on those while a long prefill runs beside decode steps, so each share is measured
    while ``beside`` keeps the rest of the threads busy (None: the rest stays idle).

    The profile's model shape is the checkpoint's ``config.json`` with the bytes per element
    of the dtype actually run; its device names this CPU, the torch threads and the dtype.
    Its ``rel_error`` says how well the linear model fits.
    """
    import torch

    model_dir = Path(model_dir)
    plan = plan or CalibrationPlan()
    engine = load_engine(model_dir, plan, dtype=dtype, threads=threads)
    assert engine.dtype is not None  # the torch engine's
    dtype_name = str(engine.dtype).removeprefix("torch.")
    shape = dataclasses.replace(
        ModelShape.from_config(model_dir / "config.json", flag="--model"),
        dtype_bytes=engine.dtype.itemsize,
    )
    all_threads = torch.get_num_threads()
    fits: list[Fitted] = []
    try:
        for n in (all_threads, *(split_shares(all_threads) if split else ())):
            torch.set_num_threads(n)
            device = describe_device(n, dtype_name)
            others: AbstractContextManager[object] = contextlib.nullcontext()
            if beside is not None and n < all_threads:
                others = beside(all_threads - n)
                device += f", beside {all_threads - n} busy threads"
            with others:
                if progress is not None:
                    progress(f"measuring {shape.name} on {device}")
                fits.append(fit(record_plan(engine, plan, progress), shape, device, threads=n))
    finally:
        torch.set_num_threads(all_threads)
    return dataclasses.replace(fits[0], shares=tuple(fits[1:]))


def split_shares(threads: int) -> tuple[int, ...]:
    """The thread counts of the two shares of the split a host lease makes by default
    (``compute.CoreSplit``: half for decode steps, the rest for the prefill beside them);
    none for an engine of one thread, which is never split."""
    if threads < 2:
        return ()
    keep = interactive_threads(threads)
    return tuple(sorted({keep, threads - keep}))


def fit_recorded(
    by_threads: Mapping[int, Sequence[Sample]], shape: ModelShape, dtype: str
) -> Fitted:
    """A profile fit to the steps serving workers recorded (``recording.read_step_logs``):
    the steps on the most threads give the profile, those on fewer its ``shares``. Steps
    that do not vary enough to fit are refused naming ``--steps``."""
    if not by_threads:
        raise InvalidArgumentError(STEPS_FLAG, "the files hold no recorded step")
    fits: list[Fitted] = []
    for threads in sorted(by_threads, reverse=True):
        device = describe_device(threads, dtype) + ", recorded while serving"
        try:
            fits.append(fit(by_threads[threads], shape, device, threads=threads))
        except InvalidArgumentError as e:
            raise InvalidArgumentError(STEPS_FLAG, f"the steps on {threads} threads: {e}") from None
    return dataclasses.replace(fits[0], shares=tuple(fits[1:]))
