"""The engine brackets each step's compute with its ComputeGate and checkpoints prefills."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.config import ModelConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class RecordingGate:
    """A ComputeGate that records what the engine asks of it."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []  # (prefill tokens, checkpoints inside)
        self._inside: int | None = None

    @contextlib.contextmanager
    def hold(self, prefill_tokens: int, decodes: int = 0) -> Iterator[None]:
        assert self._inside is None, "steps nest"
        self._inside = 0
        try:
            yield
        finally:
            self.steps.append((prefill_tokens, self._inside))
            self._inside = None

    def checkpoint(self) -> None:
        assert self._inside is not None, "checkpoint outside a held step"
        self._inside += 1

    def idle(self) -> None:
        assert self._inside is None, "idle inside a held step"


def _run(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
        out[f"r{i}"] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_gate_sees_every_step_and_checkpoints_only_prefills(tiny_llama_dir: Path) -> None:
    layers = ModelConfig.from_dir(tiny_llama_dir).num_layers
    prompts = [[5 + i for i in range(n)] for n in (7, 30, 12)]
    plain = _run(Engine.from_pretrained(tiny_llama_dir, dtype="float32"), prompts)

    engine = Engine.from_pretrained(
        tiny_llama_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4
    )
    gate = RecordingGate()
    engine.gate = gate
    assert _run(engine, prompts) == plain  # the gate changes when steps run, not what they compute
    engine.check_no_leaks()

    assert sum(tokens for tokens, _ in gate.steps) == sum(len(p) for p in prompts)
    for tokens, checkpoints in gate.steps:
        # Two per layer (after attention, after the MLP) when the step computes prompt tokens.
        assert checkpoints == (2 * layers if tokens else 0)
    assert any(tokens == 0 for tokens, _ in gate.steps), "no decode-only step was seen"
