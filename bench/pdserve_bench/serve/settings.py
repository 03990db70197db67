"""The workload, rate and SLO options of ``bench serve``, validated into one ``Settings``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve.trace_file import load_trace
from pdserve_bench.serve.cli_targets import time_scale_of
from pdserve_bench.serve.metrics import Slo
from pdserve_bench.serve.mixes import get_mix
from pdserve_bench.serve.sweep import SearchSpec
from pdserve_bench.serve.timescale import REAL_TIME, TimeScale
from pdserve_bench.serve.workload import Load

DEFAULT_REQUESTS = 100
DEFAULT_RATE = 4.0
DEFAULT_SEARCH_RANGE = (1.0, 16.0)


@dataclass(frozen=True, slots=True)
class Settings:
    """What the command line asks for, validated."""

    load: Load
    rates: list[float | None]
    search: SearchSpec | None
    slo: Slo
    request_timeout_s: float
    time_scale: TimeScale = REAL_TIME
    """Of the sim clusters under test: rates, SLOs and the timeout are in its modelled time."""
    slo_scales: tuple[float, ...] = ()
    """``--slo-scale``: the SLO is derived from the targets' isolated figures (``calibrate``)
    with the first; the others add goodput columns. Empty: ``slo`` as given."""

    def arrivals(self) -> str:
        burst = self.load.burst
        if self.load.trace is not None:
            return "trace arrival times" + (" scaled to each rate" if self.rates != [None] else "")
        if burst == 0:
            return "every request at t=0"
        return "Poisson arrivals" if burst is None else f"bursts of {burst}"

    def headline(self) -> str:
        load = self.load
        what = (
            f"mix {load.mix.name} ({load.mix.summary()})" if load.mix is not None
            else f"trace of {len(load.trace or ())} requests"
        )  # fmt: skip
        size = (
            f"{load.num_requests} measured requests" if load.num_requests is not None
            else f"arrivals over {load.duration_s:g} s" if load.duration_s is not None
            else "the whole trace"
        )  # fmt: skip
        note = self.time_scale.note()
        return (
            f"pdserve bench serve: {what}; {self.arrivals()}; {size} per point "
            f"(+{load.warmup} warm-up), seed {load.seed}" + (f"\n{note}" if note else "")
        )

    def to_json(self) -> dict[str, Any]:
        load, s = self.load, self.search
        return {
            "mix": None if load.mix is None else {"name": load.mix.name,
                                                  "summary": load.mix.summary()},
            "trace_requests": None if load.trace is None else len(load.trace),
            "arrivals": self.arrivals(),
            "seed": load.seed,
            "vocab_size": load.vocab_size,
            "num_requests": load.num_requests,
            "duration_s": load.duration_s,
            "warmup": load.warmup,
            "burst": load.burst,
            "rates": self.rates,
            "search": None if s is None else {"range": [s.low, s.high],
                                              "resolution": s.resolution, "goal": s.goal},
            "slo": {"ttft_s": self.slo.ttft_s, "itl_s": self.slo.itl_s},
            "request_timeout_s": self.request_timeout_s,
            # Rates, SLOs, records and summaries are in modelled seconds: real ones are this
            # many times longer (1: real time).
            "time_scale": self.time_scale.factor,
        }  # fmt: skip


def settings(args: argparse.Namespace) -> Settings:
    """Validate the workload, rate and SLO options (InvalidArgumentError names the option)."""
    scale = time_scale_of(args)
    trace = load_trace(args.trace) if args.trace is not None else None
    num = args.num_requests
    if num is None and args.duration is None and trace is None:
        num = DEFAULT_REQUESTS
    load = Load(
        vocab_size(args), mix=None if trace is not None else get_mix(args.mix), trace=trace,
        seed=args.seed, num_requests=num, duration_s=args.duration, warmup=args.warmup,
        burst=args.burst,
    )  # fmt: skip
    rates: list[float | None]
    if args.burst == 0 or (trace is not None and not args.rates and not args.search):
        if args.rates or args.search:
            raise InvalidArgumentError("--rates", "--burst all sends everything at once: no rate")
        rates = [None]
    else:
        rates = list(args.rates or ([] if args.search else [DEFAULT_RATE]))
    search = None
    if args.search:
        known = [r for r in rates if r is not None]
        low, high = (
            args.search_range if args.search_range is not None
            else (min(known), max(known)) if len(known) > 1 else DEFAULT_SEARCH_RANGE
        )  # fmt: skip
        if args.search_range is not None and len(args.search_range) != 2:
            raise InvalidArgumentError("--search-range", "expected two numbers: LO,HI")
        search = SearchSpec(low, high, args.search_resolution, args.goodput_target)
    if not args.request_timeout > 0:
        raise InvalidArgumentError("--request-timeout", "must be > 0")
    slo = Slo(args.ttft_slo, args.itl_slo)
    scales = tuple(args.slo_scale or ())
    if scales and load.mix is None:
        raise InvalidArgumentError("--slo-scale", "needs a mix (--mix) to calibrate with")
    return Settings(load, rates, search, slo, args.request_timeout, scale, scales)


def vocab_size(args: argparse.Namespace) -> int:
    """``--vocab-size``, else the model's (``--model``, else the ``--preset`` demo model's)."""
    if args.vocab_size is not None:
        return int(args.vocab_size)
    if args.model is not None:
        from pdserve.models.config import ModelConfig

        return ModelConfig.from_dir(args.model).vocab_size
    from pdserve.models.demo import PRESETS

    return PRESETS[args.preset].vocab_size
