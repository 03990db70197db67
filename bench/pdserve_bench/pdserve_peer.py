"""pdserve's own engine as a benchmark peer."""

from __future__ import annotations

import time
from pathlib import Path

from pdserve.engine.engine import Engine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.linear import can_prepack
from pdserve_bench.measure import PeerError, Workload


class PdservePeer:
    """``Engine.generate`` timed end to end (scheduling, sampling and detokenising included)."""

    def __init__(
        self,
        model_dir: str | Path,
        workload: Workload,
        *,
        dtype: str,
        threads: int,
        name: str = "pdserve",
        attention_kernels: bool = True,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        # The whole longest prompt fits one step's token budget (no chunking), as for vLLM;
        # prefix caching is off because repeats reuse the same prompts. Everything else is the
        # engine's default, which is its fastest configuration (prepacked weights and the
        # native attention kernels on CPU); ``attention_kernels=False`` is for A/B runs.
        self.name = name
        budget = max_num_batched_tokens or max(
            workload.max_context, workload.max_batch * workload.decode_prompt_len
        )
        self.engine = Engine.from_pretrained(
            model_dir,
            dtype=dtype,
            num_threads=threads,
            max_num_seqs=max(workload.max_batch, 1),
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
            attention_kernels=attention_kernels,
        )
        config = self.engine.config
        # How this engine is configured, printed with the results.
        runner = self.engine.runner
        assert isinstance(runner, ModelRunner)  # a real model, not a simulated one
        packed = config.prepack_weights and can_prepack(runner.device, runner.dtype)
        self.native = native = runner.native
        """Which attention passes run on the native CPU kernels."""
        attention = (
            f"attention: prefill {'native' if native.prefill else 'torch SDPA'}, "
            f"decode {'native' if native.decode else 'torch SDPA'}"
        )
        self.description = (
            f"eager PyTorch, {'oneDNN-prepacked' if packed else 'plain'} matmul weights, "
            f"{attention}, block size {config.block_size}, "
            f"max_num_batched_tokens {budget}"
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        results = self.engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        lengths = {len(r.token_ids) for r in results}
        if len(results) != len(prompts) or lengths != {max_tokens}:
            raise PeerError(f"pdserve generated {sorted(lengths)} tokens, asked for {max_tokens}")
        return seconds

    def close(self) -> None:
        del self.engine
