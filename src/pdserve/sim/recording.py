"""Drive pdserve's torch engine through a ``CalibrationPlan`` and record every step it takes.

``record_plan`` wraps the engine's runner in a ``RecordingRunner`` (which times every
``execute``) and runs the plan's shapes; each sample is the step's ``SimStep`` and its
seconds, what ``fitted.fit`` fits (``calibrate``).

The plan's shapes are chosen so that ``fit`` can tell the features apart: decode-only steps
of several batch sizes and contexts (per-sequence cost against KV reads), fresh prefills of
several lengths (per-token cost against attention pairs), and prefills after a cached prefix
(attention pairs against KV-read tokens, which fresh prefills and decodes keep proportional).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.sim.timing import SimStep, step_of

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine
    from pdserve.engine.kv_arrays import KVArray
    from pdserve.engine.outputs import StepResult
    from pdserve.engine.scheduler import SchedulerOutput
    from pdserve.engine.step_runner import StepRunner

Progress = Callable[[str], None]
Sample = tuple[SimStep, float]


class RecordingRunner:
    """A ``StepRunner`` that delegates to ``inner`` and times every step it executes.

    ``samples`` gets one ``(step_of(out), seconds)`` per ``execute`` while ``recording`` is
    true (or ``on_step`` gets it, a ``StepLog`` for one), ``seconds`` being
    ``time.perf_counter()`` around the inner call. The ``SimStep`` is read before the inner
    call: it describes the scheduler state the step computes from, which
    ``Scheduler.update`` advances only after the step. A step that raises records nothing.
    Install with ``engine.runner = RecordingRunner(engine.runner)``.
    """

    def __init__(
        self, inner: StepRunner, on_step: Callable[[SimStep, float], None] | None = None
    ) -> None:
        self.inner = inner
        self.samples: list[Sample] = []
        self.recording = True
        self._on_step = on_step or (lambda step, seconds: self.samples.append((step, seconds)))

    def execute(
        self, out: SchedulerOutput, checkpoint: Callable[[], None] | None = None
    ) -> StepResult:
        step = step_of(out)
        start = time.perf_counter()
        result = self.inner.execute(out, checkpoint)
        seconds = time.perf_counter() - start
        if self.recording:
            self._on_step(step, seconds)
        return result

    def read_layer(
        self, layer: int, block_table: list[int], num_tokens: int
    ) -> tuple[KVArray, KVArray]:
        return self.inner.read_layer(layer, block_table, num_tokens)

    def write_layer(
        self, layer: int, block_table: list[int], keys: KVArray, values: KVArray
    ) -> None:
        self.inner.write_layer(layer, block_table, keys, values)

    def __getattr__(self, name: str) -> Any:
        """Anything else the wrapped runner has (its model, its KV pool) reads through."""
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def _ints(name: str, values: tuple[int, ...], low: int = 1) -> None:
    """Refuse an empty ``values`` or one that is not an int >= ``low``."""
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
        raise InvalidArgumentError(name, f"need one or more ints >= {low}, got {values!r}")


def _capped(values: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """``values`` each capped at ``limit``, duplicates dropped, order kept."""
    return tuple(dict.fromkeys(min(v, limit) for v in values))


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """Which steps ``record_plan`` makes the engine run, each ``repeats`` times.

    ``prompt_lengths``: fresh prefills, one request alone per step. ``prefix_hits``:
    ``(cached, new)``: a prompt of ``cached`` tokens (rounded down to whole KV blocks, at
    least one) is computed, then a prompt that starts with it and adds ``new`` tokens, so
    the second step's chunk is ``new`` tokens after ``cached`` context. ``decode_batches`` x
    ``decode_contexts``: decode-only steps of B sequences whose prompts had C tokens each.
    ``warmups``: unrecorded runs of each shape before its ``repeats`` recorded ones: the
    first step of a new row count pays for kernel selection (about twice a step's time on a
    tiny model), a cost that steady serving, whose row counts recur, does not pay again.
    ``seed`` seeds the random prompt token ids.
    """

    prompt_lengths: tuple[int, ...] = (16, 64, 256, 512, 1024, 2048)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (64, 512, 2048)
    prefix_hits: tuple[tuple[int, int], ...] = ((64, 64), (256, 256), (1024, 1024), (1024, 64))
    repeats: int = 3
    warmups: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        _ints("prompt_lengths", self.prompt_lengths)
        _ints("decode_batches", self.decode_batches)
        _ints("decode_contexts", self.decode_contexts)
        if any(len(p) != 2 for p in self.prefix_hits):
            raise InvalidArgumentError("prefix_hits", "need (cached, new) pairs")
        _ints("prefix_hits", tuple(v for pair in self.prefix_hits for v in pair))
        _ints("repeats", (self.repeats,))
        _ints("warmups", (self.warmups,), low=0)

    @classmethod
    def quick(cls) -> CalibrationPlan:
        """A few small shapes: enough for ``fit``, a couple of seconds on a tiny model (for
        tests and smoke runs; too few samples for a profile worth trusting)."""
        return cls(
            prompt_lengths=(8, 32, 96),
            decode_batches=(1, 3, 6),
            decode_contexts=(16, 80),
            prefix_hits=((32, 32), (64, 8)),
            repeats=2,
        )

    def capped(self, max_model_len: int) -> CalibrationPlan:
        """The plan with every length cut to fit ``max_model_len`` (a prompt leaves room for
        one token, a decode context for ``repeats`` plus some more, a prefix-hit prompt for
        one token after its cached part and new tokens)."""
        room = max(1, max_model_len - 1)
        decode_room = max(1, max_model_len - 2 * (self.repeats + self.warmups) - 8)
        hits: list[tuple[int, int]] = []
        for cached, new in self.prefix_hits:
            cached = min(cached, max(1, room // 2))
            hit = (cached, max(1, min(new, room - cached)))
            if hit not in hits:
                hits.append(hit)
        return dataclasses.replace(
            self,
            prompt_lengths=_capped(self.prompt_lengths, room),
            decode_contexts=_capped(self.decode_contexts, decode_room),
            prefix_hits=tuple(hits),
        )

    @property
    def longest_chunk(self) -> int:
        """The most tokens a planned prompt computes in one step (its token budget)."""
        hits = (max(cached, new) for cached, new in self.prefix_hits)
        return max(max(self.prompt_lengths), max(self.decode_contexts), max(hits))

    def kv_blocks(self, block_size: int, budget: int) -> int:
        """KV blocks the plan holds at most at once (its largest decode batch, usually),
        with a little slack, when steps take at most ``budget`` tokens."""
        need = max(
            max(-(-(n + 2) // block_size) for n in self.prompt_lengths),
            max(2 * -(-(c + n + 2) // block_size) for c, n in self.prefix_hits),
            max(
                b * -(-(c + self.decode_tokens(b, c, budget) + 1) // block_size)
                for b in self.decode_batches
                for c in self.decode_contexts
            ),
        )
        return need + 8

    def decode_tokens(self, batch: int, context: int, budget: int) -> int:
        """``max_tokens`` of a decode-shape request: the steps that prefill the batch (a
        request that finished its prompt early decodes meanwhile) plus the warm-up and the
        recorded ones."""
        prefill_steps = math.ceil(batch * (context + 1) / max(1, budget - batch)) + 2
        return self.warmups + self.repeats + prefill_steps


@dataclass(slots=True)
class _Driver:
    """One engine with a ``RecordingRunner`` installed, and the prompt token source."""

    engine: Engine
    recorder: RecordingRunner
    rng: random.Random
    next_id: int = 0

    def tokens(self, n: int) -> list[int]:
        vocab = self.engine.model_config.vocab_size
        return [self.rng.randrange(vocab) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.next_id += 1
        rid = f"calibrate-{self.next_id}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def run_alone(self, prompt: list[int], *, record: bool) -> list[Sample]:
        """Prefill one request to its first token (``max_tokens=1``); the steps with a prompt
        chunk in them are returned when ``record``."""
        rid = self.add(prompt, 1)
        start = len(self.recorder.samples)
        self.recorder.recording = record
        try:
            finished = False
            while not finished:
                finished = any(o.finished for o in self.engine.step() if o.request_id == rid)
        finally:
            self.recorder.recording = False
            self.engine.abort(rid)
        return [s for s in self.recorder.samples[start:] if s[0].prefills]

    def decode_batch(self, batch: int, context: int, plan: CalibrationPlan) -> list[Sample]:
        """``batch`` requests of ``context``-token prompts prefilled and ``plan.warmups``
        decode steps run unrecorded, then up to ``plan.repeats`` decode-only steps of all of
        them recorded; all aborted after."""
        budget = self.engine.config.max_num_batched_tokens
        max_tokens = min(
            plan.decode_tokens(batch, context, budget), self.engine.max_model_len - context
        )
        ids = [self.add(self.tokens(context), max_tokens) for _ in range(batch)]
        waiting = set(ids)
        self.recorder.recording = False
        try:
            while waiting and self.engine.has_unfinished():
                waiting -= {o.request_id for o in self.engine.step()}
            for _ in range(plan.warmups):
                self.engine.step()
            start = len(self.recorder.samples)
            self.recorder.recording = True
            for _ in range(plan.repeats):
                outputs = self.engine.step()
                if any(o.finished for o in outputs) or not self.engine.has_unfinished():
                    break
        finally:
            self.recorder.recording = False
            for rid in ids:
                self.engine.abort(rid)
        return [
            s
            for s in self.recorder.samples[start:]
            if not s[0].prefills and s[0].num_decodes == batch
        ]


def record_plan(
    engine: Engine, plan: CalibrationPlan, progress: Progress | None = None
) -> list[Sample]:
    """Run ``plan`` on ``engine`` and return every recorded ``(SimStep, seconds)``.

    The engine must be idle with prefix caching on; its runner is wrapped in a
    ``RecordingRunner`` (left installed, recording off) unless it is one already. Each
    prompt's token budget should hold ``plan.longest_chunk`` tokens, or prompts are chunked
    (the samples stay valid, only the shapes differ from the plan). A first request, not
    recorded, warms the kernels up (first-call allocations), and every shape runs
    ``plan.warmups`` times unrecorded before its recorded runs.
    """
    if not engine.config.enable_prefix_caching:
        raise InvalidArgumentError(
            "enable_prefix_caching", "calibration needs it for its cached-prefix prefills"
        )
    if engine.has_unfinished():
        raise InvalidArgumentError("engine", "calibration needs an idle engine")
    say = progress or (lambda _line: None)
    plan = plan.capped(engine.max_model_len)
    recorder = engine.runner if isinstance(engine.runner, RecordingRunner) else None
    if recorder is None:
        recorder = RecordingRunner(engine.runner)
        engine.runner = recorder
    d = _Driver(engine, recorder, random.Random(plan.seed))
    samples: list[Sample] = []

    warm = min(plan.prompt_lengths)
    say(f"warm-up: a {warm}-token prompt (not recorded)")
    d.run_alone(d.tokens(warm), record=False)

    for n in plan.prompt_lengths:
        for _ in range(plan.warmups):
            d.run_alone(d.tokens(n), record=False)
        got: list[Sample] = []
        for _ in range(plan.repeats):
            got += d.run_alone(d.tokens(n), record=True)
        samples += got
        say(f"prefill {n} tokens: {len(got)} steps ({_median_ms(got)})")

    block = engine.config.block_size
    for cached, new in plan.prefix_hits:
        cached = max(block, cached // block * block)
        got = []
        for i in range(plan.warmups + plan.repeats):
            head = d.tokens(cached)
            record = i >= plan.warmups
            got += d.run_alone(head, record=record)
            got += d.run_alone(head + d.tokens(new), record=record)
        hits = [s for s in got if s[0].prefix_tokens]
        if not hits:
            raise RuntimeError(
                f"no prefill found its {cached}-token prefix in the prefix cache; "
                "the cached-prefix samples cannot be measured"
            )
        samples += got
        say(f"prefill {new} tokens after {cached} cached: {len(hits)} steps ({_median_ms(hits)})")

    for batch in plan.decode_batches:
        for context in plan.decode_contexts:
            got = d.decode_batch(batch, context, plan)
            samples += got
            say(f"decode batch {batch} at context {context}: {len(got)} steps ({_median_ms(got)})")
    return [s for s in samples if s[1] > 0]


def _median_ms(samples: list[Sample]) -> str:
    if not samples:
        return "none recorded"
    seconds = sorted(s for _, s in samples)
    return f"median {seconds[len(seconds) // 2] * 1e3:.2f} ms"


STEPS_FLAG = "--steps"


class StepLog:
    """Appends each step a serving engine runs to a JSON-lines file (a worker's
    ``--record-steps``), for ``pdserve sim calibrate --steps`` to fit: the steps as a loaded
    cluster's workers take them, with whatever the host's other work costs them.

    A line: ``{"prefills": [[tokens, context], ...], "decodes": [context, ...], "threads":
    T, "seconds": S}``; ``threads`` (called on the engine thread, per step) says which share
    of a split the step ran on. Lines are written whole, one ``write`` each, so a worker
    killed mid-run leaves every finished line readable.
    """

    def __init__(self, path: Path, threads: Callable[[], int]) -> None:
        self._file = path.open("a", encoding="utf-8", buffering=1)
        self._threads = threads

    def __call__(self, step: SimStep, seconds: float) -> None:
        line = {
            "prefills": [list(p) for p in step.prefills],
            "decodes": list(step.decodes),
            "threads": self._threads(),
            "seconds": seconds,
        }
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_logs(paths: Sequence[Path]) -> dict[int, list[Sample]]:
    """The steps of ``StepLog`` files, by the threads they ran on; a line that is not a
    step is refused naming ``--steps``, the file and the line."""
    by_threads: dict[int, list[Sample]] = {}
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(STEPS_FLAG, f"cannot read {path}: {e}") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                step = SimStep(
                    tuple((int(n), int(c)) for n, c in data["prefills"]),
                    tuple(int(d) for d in data["decodes"]),
                )
                threads, seconds = int(data["threads"]), float(data["seconds"])
            except (ValueError, TypeError, KeyError) as e:
                raise InvalidArgumentError(
                    STEPS_FLAG, f"{path}:{number} is not a recorded step ({e!r})"
                ) from None
            if threads < 1 or not seconds > 0 or step.is_empty:
                raise InvalidArgumentError(STEPS_FLAG, f"{path}:{number}: not a step that ran")
            by_threads.setdefault(threads, []).append((step, seconds))
    return by_threads
