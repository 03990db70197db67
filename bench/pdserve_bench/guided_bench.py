"""``pdserve bench guided``: what structured output costs on this machine.

One run, on the demo checkpoint (``--preset small``: a 32000-token vocabulary) or ``--model``:

1. **compile**: the first guide of an engine (xgrammar's import and the vocabulary's
   description, once per worker), then each schema cold (a cache miss: parsed and compiled
   for the vocabulary) and cached (the engine's LRU);
2. **mask**: the sampler's batched pass at ``--batch`` rows, every row guided: one bitmask
   filled by the rows' matchers, applied once to ``[batch, vocab]`` float32 logits (and the
   fills alone, the rest being the application); each step
   then advances every matcher by a token drawn from its masked row (a random walk through the
   grammar, so the matchers visit the states real outputs visit);
3. **sampler**: the sampler alone at ``--batch`` rows of random logits, none guided against
   all guided, interleaved step by step (what structured output adds to a step, free of the
   forward pass's noise);
4. **decode**: the engine's decode step at ``--batch`` requests, all guided against none: one
   engine per kind, stepped in turn (so the machine's other load falls on each alike), over
   the first ``--steps`` decode steps of each of ``--rounds`` rounds (every request still
   running: each valid instance of the schemas is longer).

Two schemas: ``typical`` (strings, an integer, an enum, a boolean, an array: no length bounds)
and ``bounded`` (the same with ``maxLength``/``pattern`` lengths), whose bounded repetitions
xgrammar cannot mask from its precomputed cache: a row inside such a string costs milliseconds.
``--json`` keeps every figure. docs/benchmarks.md has the latest results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.engine import Engine
from pdserve.engine.guide import Guide
from pdserve.engine.guided import Guides, load_xgrammar, mask_guided
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve_bench.engine_bench import load_average, machine_info, wait_for_quiet

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "active", "tags"],
}
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "nick": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "nick", "age", "role", "active"],
}
SCHEMAS = {"typical": TYPICAL, "bounded": BOUNDED}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def compile_times(engine: Engine, repeats: int) -> dict[str, Any]:
    """First guide (import + vocabulary), then each schema cold (a cache miss) and cached, in
    ms (medians); each cold run compiles a copy of the schema with its own description, which
    changes the cache key and not the grammar."""
    guides = Guides(engine.tokenizer, engine.model_config.vocab_size, cache_bytes=1 << 30)
    started = time.perf_counter()
    guides.compile(Guide.regex("[0-9]+"))
    out: dict[str, Any] = {"first_guide_ms": _ms(time.perf_counter() - started)}
    for name, schema in SCHEMAS.items():
        cold, cached = [], []
        for i in range(repeats):
            guide = Guide.json_schema({**schema, "description": f"run {i}"})
            t0 = time.perf_counter()
            guides.compile(guide)
            t1 = time.perf_counter()
            guides.compile(guide)
            cold.append(t1 - t0)
            cached.append(time.perf_counter() - t1)
        out[name] = {"cold_ms": _ms(statistics.median(cold)), "cached_ms": _ms(min(cached))}
    return out


def mask_cost(engine: Engine, batch: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Per step at ``batch`` guided rows: fill + apply (``mask_guided``), in ms, and per row
    in microseconds; matchers advance by tokens drawn from their masked rows."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        guide = Guide.json_schema(schema)
        seqs = []
        for i in range(batch):
            seq = Sequence(f"m{i}", [1], SamplingParams(guide=guide), arrival=i)
            seq.guide = engine.guides.start(guide, [], "guide")
            seqs.append(seq)
        times: list[float] = []
        fills: list[float] = []
        scratch = load_xgrammar("guide").allocate_token_bitmask(batch, vocab)
        guides = [s.guide for s in seqs]
        for _ in range(steps):
            if any(s.guide is None or s.guide.matcher.is_terminated() for s in seqs):
                break  # measured at the full batch only
            logits = torch.randn(batch, vocab, generator=gen)
            t0 = time.perf_counter()
            for i, s in enumerate(seqs):  # the fills alone (mask_guided's first part)
                assert s.guide is not None
                s.guide.matcher.fill_next_token_bitmask(scratch, i)
            t1 = time.perf_counter()
            mask_guided(logits, guides)
            times.append(time.perf_counter() - t1)
            fills.append(t1 - t0)
            tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten()
            for s, t in zip(seqs, tokens.tolist(), strict=True):
                assert s.guide is not None
                s.guide.advance(t)
        step = statistics.mean(times)
        out[name] = {
            "steps": len(times),
            "step_ms": _ms(step),
            "fill_ms": _ms(statistics.mean(fills)),
            "per_row_us": round(step / batch * 1e6, 1),
            "worst_step_ms": _ms(max(times)),
        }
    return out


def _guided_seqs(engine: Engine, batch: int, guide: Guide | None) -> list[Sequence]:
    """``batch`` sequences as the engine makes them (seeds, generators, matchers)."""
    for i in range(batch):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=64, guide=guide)
        engine.add_request(f"s{i}", "describe a user account", params)
    seqs = list(engine.scheduler.waiting)
    for i in range(batch):
        engine.abort(f"s{i}")
    return seqs


def sampler_cost(engine: Engine, batch: int, steps: int) -> dict[str, Any]:
    """The sampler alone (``sample``) at ``batch`` rows of random logits, no row guided
    against every row guided, interleaved step by step; medians in ms. The guided rows'
    matchers advance by what was drawn."""
    kinds: dict[str, Guide | None] = {"unguided": None}
    kinds.update({name: Guide.json_schema(s) for name, s in SCHEMAS.items()})
    seqs = {kind: _guided_seqs(engine, batch, guide) for kind, guide in kinds.items()}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        logits = torch.randn(batch, engine.model_config.vocab_size, generator=gen)
        for kind, rows in seqs.items():
            if any(s.guide is not None and s.guide.matcher.is_terminated() for s in rows):
                continue
            t0 = time.perf_counter()
            out = sample(logits.clone(), rows)
            times[kind].append(time.perf_counter() - t0)
            for s, token in zip(rows, out.tokens, strict=True):
                if s.guide is not None:
                    s.guide.advance(token)
    plain = statistics.median(times["unguided"])
    return {
        kind: {
            "step_ms": _ms(statistics.median(values)),
            "added_ms": _ms(statistics.median(values) - plain),
        }
        for kind, values in times.items()
    }


def decode_cost(model: Path, batch: int, steps: int, rounds: int, threads: int) -> dict[str, Any]:
    """The engine's decode step at ``batch`` requests, none guided against all guided (each
    schema): one engine per kind, stepped in turn, so that the machine's other load falls on
    every kind alike; medians in ms over the steps that decode the whole batch, and their
    ratio to the unguided one's. A first round warms every engine up, unmeasured."""
    kinds: dict[str, Guide | None] = {"unguided": None}
    kinds.update({name: Guide.json_schema(s) for name, s in SCHEMAS.items()})
    engines = {
        kind: Engine.from_pretrained(
            model, dtype="float32", max_num_seqs=batch, num_threads=threads,
            kv_cache_bytes=64 * 1024 * 1024,
        )
        for kind in kinds
    }  # fmt: skip
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(rounds + 1):
        for kind, engine in engines.items():
            for i in range(batch):
                params = SamplingParams(
                    temperature=1.0, seed=1000 * r + i, max_tokens=steps + 2,
                    ignore_eos=True, guide=kinds[kind],
                )  # fmt: skip
                engine.add_request(f"r{r}-{i}", "describe a user account", params)
        while any(e.has_unfinished() for e in engines.values()):
            for kind, engine in engines.items():
                if not engine.has_unfinished():
                    continue
                t0 = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - t0
                shape = engine.last_step
                if r > 0 and shape.prefill_tokens == 0 and shape.decodes == batch:
                    times[kind].append(elapsed)
    plain = statistics.median(times["unguided"])
    return {
        kind: {
            "steps": len(values),
            "step_ms": _ms(statistics.median(values)),
            "vs_unguided": round(statistics.median(values) / plain, 3),
        }
        for kind, values in times.items()
    }


def run(model: Path, *, batch: int, steps: int, rounds: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    engine = Engine.from_pretrained(
        model, dtype="float32", max_num_seqs=max(batch, 1), num_threads=threads
    )
    load = load_average()
    compiled = compile_times(engine, repeats=5)  # first: its first guide imports xgrammar
    machine = machine_info()
    machine["load_1min_start"] = load
    report: dict[str, Any] = {
        "machine": machine,
        "model": str(model),
        "vocab_size": engine.model_config.vocab_size,
        "batch": batch,
        "compile": compiled,
        "mask": mask_cost(engine, batch, steps=64),
        "sampler": sampler_cost(engine, batch, steps=64),
        "decode": decode_cost(model, batch, steps, rounds, threads),
    }
    report["machine"]["load_1min_end"] = load_average()
    return report


def _print(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"machine: {m['cpu']}, {m['logical_cpus']} logical CPUs ({', '.join(m['isa'])}), "
          f"torch {m['torch']}")  # fmt: skip
    print(f"load (1 min): {m['load_1min_start']:.2f} at start, {m['load_1min_end']:.2f} at end")
    print(f"model: {report['model']} (vocabulary {report['vocab_size']})")
    c = report["compile"]
    print(f"first guide of an engine (import + vocabulary): {c['first_guide_ms']:.0f} ms")
    b = report["batch"]
    head = ("schema", "compile cold", "cached", f"mask (fill) @{b}", "per row",
            f"sampler @{b}", "decode step", "vs plain")  # fmt: skip
    print(f"{head[0]:<10}{head[1]:>14}{head[2]:>10}{head[3]:>18}{head[4]:>10}{head[5]:>13}"
          f"{head[6]:>13}{head[7]:>10}")  # fmt: skip
    sp, d = report["sampler"], report["decode"]
    plain_sampler, plain_step = sp["unguided"]["step_ms"], d["unguided"]["step_ms"]
    print(f"{'unguided':<10}{'':>14}{'':>10}{'':>18}{'':>10}"
          f"{plain_sampler:>10.2f} ms{plain_step:>10.2f} ms{1.0:>10.2f}")  # fmt: skip
    for name in SCHEMAS:
        mk = report["mask"][name]
        print(
            f"{name:<10}{c[name]['cold_ms']:>11.2f} ms{c[name]['cached_ms'] * 1e3:>7.1f} us"
            f"{mk['step_ms']:>7.2f} ({mk['fill_ms']:.2f}) ms{mk['per_row_us']:>7.1f} us"
            f"{sp[name]['step_ms']:>10.2f} ms"
            f"{d[name]['step_ms']:>10.2f} ms{d[name]['vs_unguided']:>10.2f}"
        )


def main(argv: Seq[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench guided", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the demo preset)")
    p.add_argument("--preset", default="small", help="demo preset when --model is not given")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="decode steps measured per run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each kind")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--max-load", type=float, default=1.0, help="wait for a 1-minute load below")
    p.add_argument("--wait-s", type=float, default=600.0, help="wait at most this long for it")
    args = p.parse_args(list(argv))
    wait_for_quiet(args.max_load, args.wait_s, print)
    from pdserve.launcher import default_model

    model = args.model or default_model(args.preset)
    report = run(
        model, batch=args.batch, steps=args.steps, rounds=args.rounds, threads=args.threads
    )
    _print(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0
