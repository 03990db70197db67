"""One disaggregated request on TensorRT-LLM, checked: part of ``scripts/gpu_check.sh``.

Two tensorrt-llm backends on one checkpoint (a prefill and a decode engine, as two workers
would have): each prompt runs whole on the prefill engine, then as a context-only request
there and a generation-only request on the decode engine, which pulls the KV through
TensorRT-LLM's cache transceiver. The greedy tokens of the two paths must be equal.

Usage::

    python scripts/trtllm_disagg_check.py [--model DIR] [--dtype bfloat16] [--json FILE]

Without ``--model`` a tiny random-weight demo checkpoint is written to a temporary folder.
Prints one line per prompt and a summary; exits 0 when every prompt matched, 1 when one did
not or a step failed, 2 when ``tensorrt_llm`` does not import (nothing was checked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.backends import Handoff
from pdserve.backends.tensorrt_llm import TensorRTLLMBackend
from pdserve.backends.tensorrt_llm_api import TensorRTLLMConfig, unavailable
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class PromptResult:
    prompt_tokens: int
    whole: list[int]
    disaggregated: list[int]
    match: bool
    handle_bytes: int
    """Size of the transceiver state that travels in the KV handle."""


@dataclass
class Report:
    package: str
    model: str
    dtype: str
    ok: bool = False
    error: str = ""
    load_s: float = 0.0
    prompts: list[PromptResult] = field(default_factory=list)


async def check(
    model: Path, dtype: str, lengths: list[int], max_tokens: int, report: Report
) -> None:
    config = TensorRTLLMConfig(dtype=dtype, kv_max_tokens=16384, free_gpu_memory_fraction=0.2)
    started = time.perf_counter()
    prefill = TensorRTLLMBackend.from_pretrained(model, config)
    decode = TensorRTLLMBackend.from_pretrained(model, config)
    report.load_s = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rng = random.Random(0)
    try:
        await prefill.start()
        await decode.start()
        for i, n in enumerate(lengths):
            prompt = [rng.randrange(4, prefill.vocab_size) for _ in range(n)]
            whole: list[int] = []
            whole_request = EngineRequest(f"whole-{i}", tuple(prompt), greedy)
            async with aclosing(prefill.generate(whole_request)) as stream:
                async for out in stream:
                    whole += out.new_token_ids
            request = EngineRequest(f"disagg-{i}", tuple(prompt), greedy)
            pre = await prefill.prefill(request, handoff=Handoff.NATIVE)
            if pre.native is None:
                raise RuntimeError(f"prompt {i}: the context-only request kept no KV")
            first = (pre.output.new_token_ids[0], pre.output.new_logprobs[0])
            got = [first[0]]
            stream = decode.decode(request, first, pre.native)
            async with aclosing(stream):
                async for out in stream:
                    got += out.new_token_ids
            result = PromptResult(n, whole, got, whole == got, len(pre.native.opaque_state))
            report.prompts.append(result)
            print(
                f"prompt {i} ({n} tokens): {'match' if result.match else 'MISMATCH'}"
                f"  whole={whole[:8]}...  disaggregated={got[:8]}...",
                flush=True,
            )
        report.ok = all(p.match for p in report.prompts)
    finally:
        await prefill.close()
        await decode.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny demo one)")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16"])
    p.add_argument("--lengths", default="7,60,300", help="prompt lengths, comma-separated")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"SKIP: {reason}")
        return 2
    import tensorrt_llm

    package = f"tensorrt_llm {getattr(tensorrt_llm, '__version__', '?')}"
    if getattr(tensorrt_llm, "IS_FAKE", False):
        package += " (the test stand-in, not TensorRT-LLM)"
    lengths = [int(x) for x in args.lengths.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="trtllm-check-") as scratch:
        model = args.model
        if model is None:
            from pdserve.models.demo import init_checkpoint

            model = init_checkpoint(Path(scratch), "tiny")
        report = Report(package=package, model=str(model), dtype=args.dtype)
        try:
            asyncio.run(check(model, args.dtype, lengths, args.max_tokens, report))
        except Exception as err:  # reported, and the exit status says it failed
            report.error = f"{type(err).__name__}: {err}"
            print(f"FAILED: {report.error}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    matched = sum(p.match for p in report.prompts)
    print(
        f"{package}: {matched}/{len(lengths)} disaggregated requests matched the whole ones "
        f"(engines loaded in {report.load_s:.1f} s)"
    )
    return 0 if report.ok and not report.error else 1


if __name__ == "__main__":
    sys.exit(main())
