"""``SimRunner``: an engine step that takes the modelled time instead of computing.

It stands where ``ModelRunner`` stands (``engine.step_runner.StepRunner``), so the engine
above it is the real one: scheduler, paged block manager, prefix cache, KV events, hold and
export for hand-offs, imports, preemption. Per step it

1. asks the timing model for the step's seconds on the modelled accelerator (``step_of``:
   prompt chunks with their context, decodes with theirs) and stretches them by the time scale;
2. records which token sits in each KV slot it computed: the simulated KV of a position *is*
   its token id (K) and its position (V), one value per layer, so a hand-off carries a small
   real payload whose contents can be checked;
3. sleeps until the step's time is spent (per layer when a prefill streams its KV layer by
   layer, so a layer-wise transfer starts mid-step as it does on a device, or when the
   engine shares its device through a gate that lets other engines in between layers);
4. samples deterministic tokens: a hash of the prompt, the output position and the request's
   seed, never an EOS id unless the masks leave nothing else (below), so every stream runs to
   ``max_tokens`` (or to the end of its guide's grammar) and equal requests give equal streams
   on any worker, through hand-offs, migration and retries. The hash picks among the tokens
   the request's masks leave (a structured-output guide's grammar, ``allowed_token_ids``, bad
   words, ``min_tokens``'s stop tokens, a ``logit_bias`` of -100 out; a bias of +100 forces
   its token); the sim has no distribution, so penalties, ``min_p`` and other biases change
   nothing. Its logprobs are those of a point mass: 0 for the drawn token (its only
   alternative) and, for prompt logprobs, 0 and rank 1 for each prompt token.

A sequence's first decode checks that its KV slots hold its prompt's tokens: a block table
or hand-off that lost or mixed up KV fails that request, as a wrong KV would make a real
model emit garbage.
"""

from __future__ import annotations

import random
import time
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.controls import banned_by_bad_words, is_controlled
from pdserve.engine.kv_arrays import host_array
from pdserve.engine.outputs import StepResult
from pdserve.engine.sampling_params import LOGIT_BIAS_RANGE
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.sim.fitted import Fitted
from pdserve.sim.timing import SimStep, TimingModel, step_of

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

_MASK64 = (1 << 64) - 1
DIGESTS_KEPT = 1024
"""Prompt digests kept (the least recently drawn go first): more than a batch holds."""


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prompt_digest(prompt_ids: Iterable[int]) -> int:
    """A 32-bit digest of a prompt's token ids (the part of a stream's identity that every
    worker serving it knows)."""
    return zlib.crc32(array("q", prompt_ids).tobytes())


def sim_token(digest: int, position: int, seed: int, choices: int) -> int:
    """The index (below ``choices``) of output token ``position`` of a request whose prompt
    has ``digest`` and whose sampling seed is ``seed`` (0 when greedy)."""
    return _mix(digest ^ _mix((position << 32) ^ (seed & _MASK64))) % choices


class SimRunner:
    """A ``StepRunner`` that spends modelled time (see the module docstring)."""

    def __init__(
        self,
        timing: TimingModel,
        *,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        vocab_size: int,
        avoid: Iterable[int] = (),
        time_scale: float = 1.0,
        on_threads: Mapping[int, TimingModel] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``avoid``: token ids never emitted (EOS). ``time_scale``: every modelled second
        lasts this many real ones. ``on_threads``: the step times of the engine on each
        thread count it may be given (``use_threads``). ``sleep``/``clock``: injectable for
        tests."""
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.timing = timing
        self._on_threads = dict(on_threads or {})
        # Where in a fitted profile's spread each step falls (``Fitted.varied``).
        self._draws = random.Random(0)
        self.block_size = block_size
        self.num_layers = num_layers
        self.time_scale = time_scale
        banned = set(avoid)
        self._tokens = np.array([t for t in range(vocab_size) if t not in banned])
        if not len(self._tokens):
            raise ValueError("no token id is left to emit")
        self._sleep = sleep
        self._clock = clock
        # Slot -> 1 + the token id whose KV it holds; 0: never written. Zero-filled, so its
        # pages take memory only once written (a modelled pool has ~10^5-10^6 slots).
        self._kv = np.zeros(num_blocks * block_size, dtype=np.int64)
        self.modelled_s = 0.0
        """Modelled seconds of every step so far (before the time scale)."""
        self._digests: OrderedDict[int, tuple[Sequence, int]] = OrderedDict()

    def use_threads(self, threads: int) -> None:
        """Price the steps from now on as the engine's on ``threads`` threads: a
        ``compute.CoreSplit``'s ``set_threads``, called on the engine thread before a step
        and at its checkpoints. Only thread counts given in ``on_threads``."""
        if threads not in self._on_threads:
            raise ValueError(f"no step times on {threads} threads: {sorted(self._on_threads)}")
        self.timing = self._on_threads[threads]

    # -- step ----------------------------------------------------------------------------
    def execute(
        self, out: SchedulerOutput, checkpoint: Callable[[], None] | None = None
    ) -> StepResult:
        start = self._clock()
        step, timing, u = step_of(out), self.timing, self._draws.random()
        seconds = self._seconds(timing, step, u)
        failed: dict[str, str] = {}
        sampling: list[Sequence] = []
        for chunk in out.decodes:
            seq = chunk.seq
            p = seq.num_computed_tokens
            if p == seq.num_prompt_tokens:  # the first decode: all of the prompt is in place
                why = self._check_prompt(seq)
                if why is not None:
                    failed[seq.request_id] = why
            self._store(seq, p, 1)
            if seq.request_id not in failed:
                sampling.append(seq)
        hooked: list[tuple[Sequence, int]] = []
        prompt: dict[str, PromptLogprobs] = {}
        for chunk in out.prefills:
            seq = chunk.seq
            if seq.wants_prompt_logprobs:
                prompt[seq.request_id] = _point_mass_prompt(seq, chunk.num_tokens)
            self._store(seq, seq.num_computed_tokens, chunk.num_tokens)
            if chunk.samples:
                sampling.append(seq)
                if seq.layer_hook is not None:
                    hooked.append((seq, seq.num_computed_tokens + chunk.num_tokens))
        end, spent = start + seconds, seconds
        if hooked or checkpoint is not None:
            # Layer by layer: each layer's KV is out when its share of the step is spent, and
            # between layers the gate may hand the device to another engine for a while,
            # which does not count as this step's own time, or move the step to another
            # share of the threads, which prices its remaining layers anew.
            end, spent = start, 0.0
            for layer in range(self.num_layers):
                end += seconds / self.num_layers
                spent += seconds / self.num_layers
                self._wait_until(end)
                for seq, ctx in hooked:
                    assert seq.layer_hook is not None
                    k, v = self.read_layer(layer, seq.block_table, ctx)
                    seq.layer_hook(layer, k, v)
                if checkpoint is not None and layer + 1 < self.num_layers:
                    before = self._clock()
                    checkpoint()
                    end += self._clock() - before
                    if self.timing is not timing:
                        timing = self.timing
                        seconds = self._seconds(timing, step, u)
        self.modelled_s += spent / self.time_scale
        self._wait_until(end)
        drawn: dict[str, tuple[int, float]] = {}
        top: dict[str, TopLogprobs] = {}
        for s in sampling:
            token = self.token_for(s)
            if token is None:
                failed[s.request_id] = (
                    "no token is left to sample: the logits controls (or the guide) mask all"
                )
            else:
                drawn[s.request_id] = (token, 0.0)
                if s.params.logprobs:
                    top[s.request_id] = TopLogprobs((token,), (0.0,))
        return StepResult(drawn, failed, top=top, prompt=prompt)

    def _seconds(self, timing: TimingModel, step: SimStep, u: float) -> float:
        """Real seconds of ``step`` on ``timing``, at quantile ``u`` of a fitted profile's
        spread (a roofline's steps take their modelled time exactly)."""
        modelled = timing.step_time(step)
        if isinstance(timing, Fitted):
            modelled = timing.varied(modelled, u)
        return modelled * self.time_scale

    def token_for(self, seq: Sequence) -> int | None:
        """The token ``seq`` draws next (None: its masks leave none)."""
        position = len(seq) - seq.num_prompt_tokens
        seed = 0 if seq.params.greedy else seq.seed
        choices = self._choices(seq) if is_controlled(seq) else self._tokens
        if not len(choices):
            return None
        return int(choices[sim_token(self._digest(seq), position, seed, len(choices))])

    def _choices(self, seq: Sequence) -> np.ndarray:
        """The token ids ``seq``'s masks leave this step, ascending; EOS only when the allowed
        ids (or the guide's grammar) leave nothing else."""
        p = seq.params
        choices = self._tokens
        # The hard masks (the grammar's, as on a real engine; the allowed ids), EOS included:
        # the hash prefers what they leave without it.
        allowed = seq.guide.allowed_tokens() if seq.guide is not None else None
        if p.allowed_token_ids:
            ids = np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64))
            allowed = ids if allowed is None else np.intersect1d(allowed, ids, assume_unique=True)
        if allowed is not None:
            kept = np.intersect1d(choices, allowed, assume_unique=True)
            choices = kept if len(kept) else allowed
        forbidden = banned_by_bad_words(p.bad_words_token_ids, seq.output_token_ids)
        forbidden += [t for t, b in p.logit_bias.items() if b <= -LOGIT_BIAS_RANGE]
        if seq.num_output_tokens < p.min_tokens:
            forbidden += p.stop_token_ids
        if forbidden:
            choices = choices[~np.isin(choices, np.asarray(forbidden, dtype=np.int64))]
        forced = [t for t, b in p.logit_bias.items() if b >= LOGIT_BIAS_RANGE]
        if forced:
            kept = np.intersect1d(choices, np.asarray(forced, dtype=np.int64))
            choices = kept if len(kept) else choices
        return choices

    def _digest(self, seq: Sequence) -> int:
        """The prompt's digest, hashed once per sequence rather than once per token: a decode
        step draws for every running sequence, and prompts run to thousands of tokens."""
        known = self._digests.get(id(seq))
        if known is not None and known[0] is seq:  # the same object, not a reused id
            self._digests.move_to_end(id(seq))
            return known[1]
        digest = prompt_digest(seq.token_ids[: seq.num_prompt_tokens])
        self._digests[id(seq)] = (seq, digest)
        if len(self._digests) > DIGESTS_KEPT:
            self._digests.popitem(last=False)  # the least recently drawn
        return digest

    def _wait_until(self, deadline: float) -> None:
        left = deadline - self._clock()
        if left > 0:
            self._sleep(left)

    # -- the simulated KV ----------------------------------------------------------------
    def _slots(self, block_table: list[int], start: int, count: int) -> np.ndarray:
        pos = np.arange(start, start + count)
        table = np.asarray(block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _store(self, seq: Sequence, start: int, count: int) -> None:
        slots = self._slots(seq.block_table, start, count)
        self._kv[slots] = np.asarray(seq.token_ids[start : start + count], dtype=np.int64) + 1

    def _check_prompt(self, seq: Sequence) -> str | None:
        n = seq.num_prompt_tokens
        held = self._kv[self._slots(seq.block_table, 0, n)] - 1
        bad = np.flatnonzero(held != np.asarray(seq.token_ids[:n], dtype=np.int64))
        if not len(bad):
            return None
        return (
            f"the simulated KV of {seq.request_id!r} does not hold its prompt: "
            f"{len(bad)} of {n} positions differ, the first at {int(bad[0])}"
        )

    def read_layer(
        self, layer: int, block_table: list[int], num_tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """K: the token id of each position, V: the position; ``[num_tokens, 1, 1]`` float32
        (exact below 2**24), the same in every layer."""
        tokens = self._kv[self._slots(block_table, 0, num_tokens)] - 1
        k = tokens.astype(np.float32).reshape(num_tokens, 1, 1)
        v = np.arange(num_tokens, dtype=np.float32).reshape(num_tokens, 1, 1)
        return k, v

    def write_layer(
        self, layer: int, block_table: list[int], keys: KVArray, values: KVArray
    ) -> None:
        """Import a layer: its V must count the positions (anything else is a payload that
        was cut or reordered on the way); its K lands in the slots."""
        k, v = host_array(keys), host_array(values)
        n = k.shape[0]
        if tuple(k.shape) != (n, 1, 1) or tuple(v.shape) != (n, 1, 1):
            raise ValueError(f"simulated KV must be [n, 1, 1], got {tuple(k.shape)}")
        positions = v.reshape(-1).astype(np.float32)
        if not np.array_equal(positions, np.arange(n, dtype=np.float32)):
            raise ValueError(f"layer {layer} of the simulated KV is out of order")
        slots = self._slots(block_table, 0, n)
        self._kv[slots] = k.reshape(-1).astype(np.int64) + 1


def _point_mass_prompt(seq: Sequence, num_tokens: int) -> PromptLogprobs:
    """The sim's prompt logprobs for a chunk: each prompt token certain (see the module
    docstring)."""
    assert seq.prompt_logprobs is not None
    done = len(seq.prompt_logprobs.logprobs)
    end = min(seq.num_computed_tokens + num_tokens, seq.num_prompt_tokens - 1)
    targets = seq.token_ids[done + 1 : end + 1]
    top = [TopLogprobs((t,), (0.0,)) for t in targets] if seq.params.prompt_logprobs else []
    return PromptLogprobs(logprobs=[0.0] * len(targets), ranks=[1] * len(targets), top=top)
