"""``pdserve bench faults``: SIGKILL each kind of process in turn under load; what was lost.

::

    pdserve bench faults --preset tiny --rate 4 --json faults.json
    pdserve bench faults --kinds router,scheduler --window-s 10

For each kind (``scenarios``): a fresh supervised cluster, Poisson arrivals at ``--rate``
(the same requests every time, seeded), the victim SIGKILLed ``--warmup-s`` into the load,
arrivals going on for ``--window-s`` more, every answer checked against the engine run here
(``drive``), then the census of what the cluster still holds (``leaks``). Run it at about
half the cluster's capacity (``pdserve bench serve --search`` finds the capacity).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.errors import InvalidArgumentError
from pdserve_bench.faults.drive import FaultResult, Job, run
from pdserve_bench.faults.scenarios import SCENARIOS, pick
from pdserve_bench.tables import format_table

FIRST_TOKEN = 16


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench faults", description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="", help=f"comma-separated, of {', '.join(SCENARIOS)} "
                   "(default: all, in that order)")  # fmt: skip
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the --preset demo)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--rate", type=float, default=4.0, help="requests/s (default 4)")
    p.add_argument("--warmup-s", type=float, default=4.0, help="load before the kill")
    p.add_argument("--window-s", type=float, default=8.0, help="load after the kill")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--deadline-s", type=float, default=60.0, help="per request, retries in")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="every result, with the machine")
    return p


def jobs(model: Path, n: int, rate: float, max_tokens: int, seed: int) -> list[Job]:
    """``n`` greedy requests at Poisson times, with the engine's own answers (float32)."""
    from pdserve.engine.engine import Engine
    from pdserve.engine.sampling_params import SamplingParams

    engine = Engine.from_pretrained(model, dtype="float32")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randrange(20, 90))]
               for _ in range(n)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    answers = engine.generate(prompts, [params] * n)
    t, out = 0.0, []
    for prompt, answer in zip(prompts, answers, strict=True):
        t += rng.expovariate(rate)
        out.append(Job(prompt, list(answer.token_ids), t))
    return out


def table(results: Sequence[FaultResult]) -> list[str]:
    head = ["killed", "sent", "ok", "wrong", "lost", "restarted", "retried",
            "TTFT p99 before s", "TTFT p99 after s", "victim restarts", "clean after s",
            "left"]  # fmt: skip

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    rows = [head]
    for r in results:
        left = ", ".join(f"{k} {v}" for k, v in r.left.to_json().items() if v) or "nothing"
        rows.append([r.scenario, str(r.sent), str(r.ok), str(r.wrong), str(r.lost),
                     str(r.restarts), str(r.retries), sec(r.ttft_p99_before_s),
                     sec(r.ttft_p99_window_s), str(r.victim_restarts), sec(r.clean_after_s),
                     left])  # fmt: skip
    return format_table(rows)


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    for flag in ("rate", "warmup_s", "window_s", "deadline_s"):
        if not getattr(args, flag) > 0:
            raise InvalidArgumentError(f"--{flag.replace('_', '-')}", "must be > 0")
    scenarios = pick([k for k in args.kinds.split(",") if k])
    from pdserve.launcher import default_model
    from pdserve_bench.engine_bench import machine_info

    model = args.model if args.model is not None else default_model(args.preset)
    machine = machine_info()
    print(f"pdserve bench faults: {model.name}, {args.rate:g} req/s, kill at "
          f"{args.warmup_s:g} s, {args.window_s:g} s after", flush=True)  # fmt: skip
    print(f"machine: {machine}", flush=True)
    n = max(1, round(args.rate * (args.warmup_s + args.window_s)))
    work = jobs(model, n, args.rate, args.max_tokens, args.seed)
    results = []
    for s in scenarios:
        print(f"  {s.name}: killing {s.victim} ...", file=sys.stderr, flush=True)
        with s.make(model) as cluster:
            results.append(asyncio.run(run(s, cluster, work, kill_at_s=args.warmup_s,
                                           deadline_s=args.deadline_s)))  # fmt: skip
    print("\n".join(table(results)))
    for r in results:
        for e in r.errors:
            print(f"  {r.scenario}: {e}")
    if args.json is not None:
        doc = {"argv": ["bench", "faults", *argv], "machine": machine,
               "results": [r.to_json() for r in results]}  # fmt: skip
        args.json.write_text(json.dumps(doc) + "\n")
    return 0 if all(r.ok == r.sent and r.left.clean for r in results) else 1
