"""Write a JSONL trace (``pdserve bench serve --trace``) whose mix shifts mid-run.

    python scripts/shift_trace.py --out shift.jsonl --mixes long-prompt-heavy,chat \\
        --requests 60 --rate 2 --seed 0

``--requests`` requests of each mix in turn, Poisson arrivals at ``--rate`` per second (the
benchmark rescales them to each ``--rates`` value, keeping the shape). The P:D planner's
benchmark uses it: prefill-heavy first, decode-heavy after (docs/benchmarks.md).
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
    p.add_argument("--requests", type=int, default=60, help="requests of each mix")
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    t = 0.0
    lines = []
    for name in args.mixes.split(","):
        mix = get_mix(name.strip())
        if not mix.classes:
            p.error(f"{name}: a mix of request classes is needed (not conversations)")
        for _ in range(args.requests):
            t += rng.expovariate(args.rate)
            cls = mix.draw_class(rng)
            prompt, output = cls.prompt.draw(rng), cls.output.draw(rng)
            lines.append({"prompt_tokens": prompt, "output_tokens": output, "arrival_s": t})
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {len(lines)} requests over {t:.1f} s to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
