"""The ``sim`` backend: pdserve's engine on a ``SimRunner``, behind ``TorchBackend``.

What is real: the engine loop, the continuous-batching scheduler, the paged block manager
and its prefix cache (and so KV events), admission, hold/export for hand-offs, imports,
aborts, migration, capacity and the step meter that heartbeats publish; above it every
worker, transport, scheduler and router path runs unchanged. What is modelled: the time of
each step (``sim.profile``), the KV pool's size (the modelled accelerator's memory, or the
engine flags) and the time a hand-off's KV takes on the modelled link (``sim.links``),
spent before the decode starts. The KV that moves is a small stand-in (``sim.runner``):
one float per token and layer for K (the token id) and one for V (the position).

The served vocabulary, tokenizer and length limits are the checkpoint directory's
(``--model``; its weights are never read, so a directory with ``config.json`` and
``tokenizer.json`` is enough); the modelled model only sets the timing and the KV bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.backends.base import SIM
from pdserve.backends.pytorch import TorchBackend
from pdserve.compute.lease import CoreSplit, interactive_threads
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.gate import ComputeGate
from pdserve.engine.kv_payload import KVLayout
from pdserve.engine.step_runner import Compute, ComputeFactory
from pdserve.engine_loop.async_engine import AsyncEngine
from pdserve.errors import InvalidArgumentError
from pdserve.models.config import ModelConfig
from pdserve.sim.flags import DEFAULT_LINK
from pdserve.sim.links import parse_link
from pdserve.sim.profile import SimProfile, parse_profile
from pdserve.sim.runner import SimRunner
from pdserve.tokenizer import Tokenizer
from pdserve.transfer.links import Link, Links

SIM_KV_DTYPE = "float32"
"""The stand-in KV's dtype: token ids and positions are exact in it below 2**24."""


@dataclass(frozen=True, slots=True)
class SimOptions:
    """What a sim worker models (``--sim-profile``, ``--sim-time-scale``, ``--sim-link``)."""

    profile: SimProfile
    time_scale: float = 1.0
    """Every modelled second lasts this many real ones (> 0)."""
    link: Link = field(default_factory=lambda: parse_link(DEFAULT_LINK))
    """The link a hand-off's KV crosses to reach this worker."""

    @classmethod
    def parse(cls, profile: str, time_scale: float = 1.0, link: str = DEFAULT_LINK) -> SimOptions:
        """From the flags' values; ``InvalidArgumentError`` names the flag at fault."""
        if not time_scale > 0:
            raise InvalidArgumentError("--sim-time-scale", f"must be > 0, got {time_scale}")
        return cls(parse_profile(profile), time_scale, parse_link(link))

    def links(self, host: str) -> Links:
        """A sim worker's ``Links``: the modelled link for the hand-offs between this host's
        workers, in real bytes/s (the link's rate over the time scale), kept as modelled.
        What the transports measure moving the stand-in payload says nothing of the modelled
        KV, so the worker chooses its transports, and its heartbeat publishes, by these."""
        rate = self.link.bytes_per_s / self.time_scale
        return Links(host, [(host, k, rate) for k in ("shm", "direct")], modelled=True)

    def transfer_s(self, num_tokens: int) -> float:
        """Real seconds the modelled link takes for the modelled KV of ``num_tokens``."""
        nbytes = num_tokens * self.profile.model.kv_bytes_per_token
        return self.link.transfer_time_s(nbytes) * self.time_scale


def sim_fingerprint(model_dir: Path, profile: SimProfile) -> str:
    """What sim workers must share to exchange KV: the modelled model and the served
    vocabulary (config and tokenizer files; no weights are read)."""
    h = hashlib.sha256(profile.model.name.encode())
    for name in ("config.json", "tokenizer.json"):
        file = model_dir / name
        if file.is_file():
            h.update(file.read_bytes())
    return f"sim-{h.hexdigest()[:16]}"


def sim_compute(options: SimOptions) -> ComputeFactory:
    """A ``SimRunner`` and its stand-in layout. The pool holds ``num_kv_blocks`` if given,
    else what the modelled accelerator's memory holds (roofline), else ``kv_cache_bytes`` of
    the modelled model's KV (fitted)."""
    model = options.profile.model

    def build(model_dir: Path, mc: ModelConfig, config: EngineConfig, max_len: int) -> Compute:
        block = config.block_size
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif options.profile.kv_tokens is not None:
            num_blocks = max(2, options.profile.kv_tokens // block)
        else:
            num_blocks = max(2, config.kv_cache_bytes // (model.kv_bytes_per_token * block))
        tokenizer = Tokenizer.from_dir(model_dir)
        runner = SimRunner(
            options.profile.timing,
            num_blocks=num_blocks,
            block_size=block,
            num_layers=model.num_layers,
            vocab_size=min(mc.vocab_size, tokenizer.vocab_size),
            avoid=tokenizer.eos_token_ids,
            time_scale=options.time_scale,
            on_threads=options.profile.on_threads,
        )
        layout = KVLayout(
            model_fingerprint=sim_fingerprint(model_dir, options.profile),
            dtype=SIM_KV_DTYPE,
            num_layers=model.num_layers,
            num_kv_heads=1,
            head_dim=1,
            block_size=block,
        )
        return Compute(runner, layout, num_blocks)

    return build


def sim_split(
    profile: SimProfile, keep: int | None, set_threads: Callable[[int], None]
) -> CoreSplit | None:
    """How a sim engine splits the threads of the CPU host its profile measured, as a torch
    engine does (``--lease-split-threads``: None keeps half, 0 takes turns); None where the
    profile was not measured on the shares of a split (an accelerator is never split)."""
    on = profile.on_threads
    if not on or keep == 0:
        return None
    threads = max(on)
    keep = interactive_threads(threads, keep)
    if keep not in on or threads - keep not in on:
        raise InvalidArgumentError(
            "--lease-split-threads",
            f"the profile has step times on {sorted(on)} threads, not on both shares of a "
            f"split that keeps {keep} of {threads}",
        )
    return CoreSplit(threads=threads, interactive=keep, set_threads=set_threads)


def sim_backend(
    model_dir: str | Path,
    options: SimOptions,
    *,
    batch_window_ms: float = 0.0,
    lease: Callable[[CoreSplit | None], ComputeGate] | None = None,
    split_threads: int | None = None,
    **config: Any,
) -> TorchBackend:
    """A sim worker's backend on ``model_dir``'s vocabulary; ``config`` holds
    ``EngineConfig`` fields. ``lease`` makes the gate shared with other engines, given the
    split of threads its profile models (``sim_split``, ``split_threads``): the modelled
    steps then split the host's threads as torch engines do, or take turns, as on one
    shared device. Call ``start()`` next."""
    config.pop("num_threads", None)  # nothing computes: no thread pool to size
    engine = Engine.from_pretrained(model_dir, compute=sim_compute(options), **config)
    if lease is not None:
        runner = engine.runner
        assert isinstance(runner, SimRunner)  # sim_compute's
        engine.gate = lease(sim_split(options.profile, split_threads, runner.use_threads))
    return TorchBackend(
        AsyncEngine(engine, batch_window_ms=batch_window_ms),
        name=SIM,
        kv_bytes_per_token=options.profile.model.kv_bytes_per_token,
        import_delay=lambda kv: options.transfer_s(kv.num_tokens),
    )
