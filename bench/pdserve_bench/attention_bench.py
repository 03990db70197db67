"""``pdserve bench attention``: the engine on the native CPU attention kernels against the same
engine on torch's SDPA (``attention_kernels=False``), side by side in one process.

Both engines load the same checkpoint; every case runs on both, interleaved repeat by repeat
(``pdserve_bench.measure``: prefill = ``generate(max_tokens=1)``, decode = ``t_N - t_1``), so
load from elsewhere hits both alike. Cases: prefill of each ``--prefill-lens`` prompt; decode at
each ``--decode-batches`` batch with short prompts ("short") and with one ``--long-prompt-len``
prompt among the short ones ("mixed": the case the torch path pads or groups). The table gives
the medians and the speedup, torch's time over the kernels'; docs/benchmarks.md has results.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.errors import InvalidArgumentError
from pdserve.models.config import ModelConfig
from pdserve_bench.engine_bench import load_average, machine_info, wait_for_quiet
from pdserve_bench.measure import Case, CaseResult, Workload, make_prompts, run_case_list
from pdserve_bench.pdserve_peer import PdservePeer
from pdserve_bench.tables import format_table

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class AttentionWorkload:
    """What ``bench attention`` measures."""

    prefill_lens: tuple[int, ...] = (512, 1024, 2048, 4096)
    decode_batches: tuple[int, ...] = (1, 4, 16, 32)
    short_prompt_len: int = 32
    long_prompt_len: int = 2048
    decode_tokens: int = 64
    repeats: int = 5
    warmup_tokens: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prefill_lens and not self.decode_batches:
            raise InvalidArgumentError("prefill_lens", "need a prefill length or a decode batch")
        if min((*self.prefill_lens, *self.decode_batches), default=1) < 1:
            raise InvalidArgumentError("prefill_lens", "lengths and batches must be positive")
        if min(self.short_prompt_len, self.long_prompt_len, self.repeats) < 1:
            raise InvalidArgumentError("repeats", "prompt lengths and repeats must be >= 1")
        if self.decode_tokens < 2:
            raise InvalidArgumentError("decode_tokens", "must be >= 2 (decode = t_N - t_1)")

    def cases(self, vocab_size: int) -> list[Case]:
        rng = random.Random(self.seed)
        out = [
            Case(f"prefill {n}", "prefill", make_prompts(rng, 1, n, vocab_size), 1)
            for n in self.prefill_lens
        ]
        for b in self.decode_batches:
            short = make_prompts(rng, b, self.short_prompt_len, vocab_size)
            out.append(Case(f"decode b{b} short", "decode", short, self.decode_tokens))
            long = make_prompts(rng, 1, self.long_prompt_len, vocab_size)
            out.append(Case(f"decode b{b} mixed", "decode", long + short[1:], self.decode_tokens))
        return out

    def token_budget(self) -> int:
        """A step's token budget that prefills every case's prompts in one step."""
        batch = max(self.decode_batches, default=1)
        mixed = self.long_prompt_len + (batch - 1) * self.short_prompt_len
        return max((*self.prefill_lens, mixed, batch * self.short_prompt_len)) + 1


def speedups(torch_res: CaseResult, native_res: CaseResult) -> tuple[float, float]:
    """(torch median / native median, median of the per-repeat torch / native ratios)."""
    pairs = [t / n for t, n in zip(torch_res.seconds, native_res.seconds, strict=True) if n > 0]
    ratio = torch_res.median_seconds / native_res.median_seconds
    return ratio, statistics.median(pairs) if pairs else float("nan")


def table(results: dict[str, dict[str, CaseResult]]) -> list[str]:
    rows = [["case", "unit", "torch SDPA", "native", "speedup", "per-repeat"]]
    for name, t in results["torch"].items():
        n = results["native"][name]
        ratio, paired = speedups(t, n)
        rows.append([
            name, "s", f"{t.median_seconds:.4f}", f"{n.median_seconds:.4f}",
            f"{ratio:.2f}x", f"{paired:.2f}x",
        ])  # fmt: skip
    return format_table(rows)


def run(
    model_dir: Path, workload: AttentionWorkload, *, threads: int, dtype: str, log: Log
) -> dict[str, dict[str, CaseResult]]:
    cfg = ModelConfig.from_dir(model_dir)
    sizing = Workload(
        prefill_lens=workload.prefill_lens or (1,),
        decode_batches=workload.decode_batches or (1,),
        decode_prompt_len=workload.short_prompt_len,
        decode_tokens=workload.decode_tokens,
    )
    budget = workload.token_budget()
    peers = [
        PdservePeer(model_dir, sizing, dtype=dtype, threads=threads, name=name,
                    attention_kernels=kernels, max_num_batched_tokens=budget)
        for name, kernels in (("torch", False), ("native", True))
    ]  # fmt: skip
    native = peers[1].native
    if not (native.prefill or native.decode):
        raise InvalidArgumentError("model", "the native attention kernels do not run here")
    for p in peers:
        log(f"{p.name}: {p.description}")
    try:
        return run_case_list(
            peers, workload.cases(cfg.vocab_size), workload.repeats, workload.warmup_tokens, log
        )
    finally:
        for p in peers:
            p.close()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parser() -> argparse.ArgumentParser:
    d = AttentionWorkload()
    p = argparse.ArgumentParser(prog="pdserve bench attention", description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--prefill-lens", type=_ints, default=d.prefill_lens)
    p.add_argument("--decode-batches", type=_ints, default=d.decode_batches)
    p.add_argument("--short-prompt-len", type=int, default=d.short_prompt_len)
    p.add_argument("--long-prompt-len", type=int, default=d.long_prompt_len)
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--max-load", type=float, default=1.0, help="see --wait-minutes")
    p.add_argument(
        "--wait-minutes", type=float, default=0.0,
        help="wait up to this long for the 1-minute load to drop below --max-load",
    )  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write every sample to this file")
    return p


def main(argv: Sequence[str]) -> int:
    """Entry of ``pdserve bench attention``."""
    args = parser().parse_args(list(argv))
    if args.threads < 1:
        raise InvalidArgumentError("threads", f"must be >= 1, got {args.threads}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    workload = AttentionWorkload(
        prefill_lens=args.prefill_lens,
        decode_batches=args.decode_batches,
        short_prompt_len=args.short_prompt_len,
        long_prompt_len=args.long_prompt_len,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
    )
    wait_for_quiet(args.max_load, args.wait_minutes * 60.0, log)
    torch.set_num_threads(args.threads)
    start_load = load_average()
    results = run(args.model, workload, threads=args.threads, dtype=args.dtype, log=log)
    end_load = load_average()
    print("\n".join(table(results)))
    print(f"1-minute load: {start_load} at start, {end_load} at end")
    if args.json is not None:
        doc = {
            "machine": machine_info(),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "load_1min": [start_load, end_load],
            "results": {
                peer: {case: r.to_json() for case, r in cases.items()}
                for peer, cases in results.items()
            },
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0
