"""Write a JSONL trace (``pdserve bench serve --trace``) whose mix shifts mid-run.

    python scripts/shift_trace.py --out shift.jsonl --mixes long-prompt-heavy,chat \\
        --requests 60 --rate 2 --seed 0

``--requests`` requests of each mix in turn, Poisson arrivals at ``--rate`` per second: one
rate for all, or one per mix (``--rate 40,70,40``). The benchmark rescales the arrivals to
each ``--rates`` value, keeping the shape. The P:D planner's benchmark uses it:
prefill-heavy, then decode-heavy, then prefill-heavy again (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from pdserve_bench.serve.mixes import get_mix


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mixes", default="long-prompt-heavy,chat", help="comma-separated, in order")
    p.add_argument("--requests", default="60", help="requests of each mix: one, or one per mix")
    p.add_argument("--rate", default="2", help="mean arrivals per second: one, or one per mix")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.mixes.split(",")]
    rates = _per_mix(p, "--rate", args.rate, len(names), float)
    counts = [int(c) for c in _per_mix(p, "--requests", args.requests, len(names), int)]
    rng = random.Random(args.seed)
    t = 0.0
    lines = []
    for name, rate, count in zip(names, rates, counts, strict=True):
        mix = get_mix(name)
        if not mix.classes:
            p.error(f"{name}: a mix of request classes is needed (not conversations)")
        for _ in range(count):
            t += rng.expovariate(rate)
            cls = mix.draw_class(rng)
            prompt, output = cls.prompt.draw(rng), cls.output.draw(rng)
            lines.append({"prompt_tokens": prompt, "output_tokens": output, "arrival_s": t})
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {len(lines)} requests over {t:.1f} s to {args.out}", file=sys.stderr)
    return 0


def _per_mix(
    p: argparse.ArgumentParser, flag: str, spec: str, n: int, kind: type[float] | type[int]
) -> list[float]:
    """One value for every mix, or one per mix; each > 0."""
    try:
        values = [kind(v) for v in spec.split(",")]
    except ValueError:
        p.error(f"{flag}: expected numbers separated by commas, got {spec!r}")
    if len(values) == 1:
        values *= n
    if len(values) != n or any(not v > 0 for v in values):
        p.error(f"{flag}: need one value > 0, or one per mix ({n}), got {spec!r}")
    return values


if __name__ == "__main__":
    sys.exit(main())
