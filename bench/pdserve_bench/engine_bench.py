"""``pdserve bench engine``: pdserve's engine beside HF transformers and vLLM's CPU build.

One run loads the same checkpoint into every peer, measures the machine's memory bandwidth,
then times prefill (1K and 4K prompts) and decode (batch 1, 8, 32) on all peers interleaved
(see ``pdserve_bench.measure`` for the method) and prints one table. ``--json`` keeps every
sample. docs/benchmarks.md has the commands and the latest results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pdserve.cpuinfo import cpu_model, isa_flags
from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.models.config import ModelConfig
from pdserve_bench.measure import Peer, PeerError, Workload, run_cases
from pdserve_bench.membw import DEFAULT_BYTES, decode_roofline, measure_bandwidth
from pdserve_bench.report import CHUNKED, BenchReport

Log = Callable[[str], None]


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS does not report one."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def wait_for_quiet(max_load: float, wait_s: float, log: Log, poll_s: float = 60.0) -> float | None:
    """Poll the load average until it drops to ``max_load`` or ``wait_s`` has passed.

    Other work on a small machine distorts every figure, so a measurement should start on a
    quiet machine; returns the last load seen (the run goes ahead either way, and records it).
    """
    deadline = time.monotonic() + wait_s
    load = load_average()
    while load is not None and load > max_load and time.monotonic() < deadline:
        left = deadline - time.monotonic()
        log(f"1-minute load {load:.2f} > {max_load}: waiting (up to {left:.0f} s more)")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        load = load_average()
    if load is not None and load > max_load:
        log(f"warning: 1-minute load is {load:.2f}; figures will be depressed by other work")
    return load


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "isa": list(isa_flags()),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def run_bench(
    model_dir: str | Path,
    *,
    workload: Workload | None = None,
    threads: int = 2,
    dtype: str = "bfloat16",
    include_hf: bool = True,
    vllm_python: str | Path | None = None,
    prefill_chunk: int = 0,
    membw_bytes: int = DEFAULT_BYTES,
    log: Log = lambda _msg: None,
) -> BenchReport:
    """Measure bandwidth, then every case on every requested peer; see the module docstring.
    ``prefill_chunk``: also pdserve with that token budget per step, so longer prompts are
    prefilled in chunks of it (0: not measured)."""
    workload = workload or Workload()
    if threads < 1:
        raise InvalidArgumentError("threads", f"must be >= 1, got {threads}")
    if prefill_chunk < 0 or 0 < prefill_chunk < workload.max_batch:
        raise InvalidArgumentError(
            "prefill_chunk", f"must be 0 or >= the largest decode batch, got {prefill_chunk}"
        )
    if dtype not in ("bfloat16", "float32"):
        raise InvalidArgumentError("dtype", f"must be bfloat16 or float32, got {dtype!r}")
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    machine = machine_info()
    machine["load_1min_start"] = load_average()

    log(f"memory bandwidth ({membw_bytes / 2**20:.0f} MiB, {threads} threads) ...")
    bandwidth = measure_bandwidth(membw_bytes, threads)
    mean_ctx = workload.decode_prompt_len + workload.decode_tokens / 2
    roofline = decode_roofline(
        model_dir, bandwidth.read_gbps, mean_ctx, torch.finfo(getattr(torch, dtype)).bits // 8
    )

    peers: list[Peer] = []
    skipped: dict[str, str] = {}
    try:
        from pdserve_bench.pdserve_peer import PdservePeer

        log("loading pdserve ...")
        pdserve_peer = PdservePeer(model_dir, workload, dtype=dtype, threads=threads)
        peers.append(pdserve_peer)
        machine["pdserve_config"] = pdserve_peer.description
        log(f"pdserve engine: {pdserve_peer.description}")
        if prefill_chunk:
            log(f"loading pdserve, prefilling in chunks of {prefill_chunk} tokens ...")
            chunked = PdservePeer(
                model_dir,
                workload,
                dtype=dtype,
                threads=threads,
                name=CHUNKED,
                max_num_batched_tokens=prefill_chunk,
            )
            peers.append(chunked)
        if include_hf:
            from pdserve_bench.hf_peer import HFPeer

            log("loading HF transformers ...")
            peers.append(HFPeer(model_dir, dtype=dtype, threads=threads))
        else:
            skipped["hf"] = "not requested (--no-hf)"
        if vllm_python is not None:
            from pdserve_bench.vllm_peer import VllmPeer

            log(f"starting vLLM in {vllm_python} ...")
            try:
                vllm = VllmPeer(vllm_python, model_dir, workload, dtype=dtype, threads=threads)
            except (PeerError, WorkerUnavailableError) as e:
                # A broken vLLM install must not cost the other peers' figures: the reason is
                # printed under the table and kept in the JSON.
                skipped["vllm"] = f"failed to start: {e}"
                log(f"vLLM skipped: {e}")
            else:
                peers.append(vllm)
                machine["vllm"] = vllm.version
                machine["vllm_startup_s"] = vllm.startup_s
                machine["vllm_log"] = str(vllm.log_path)
        else:
            skipped["vllm"] = "no --vllm-python given"
        results = run_cases(peers, workload, cfg.vocab_size, log)
    finally:
        for peer in reversed(peers):
            peer.close()
    machine["load_1min_end"] = load_average()
    settings = {
        "model": str(model_dir.resolve()),
        "threads": threads,
        "dtype": dtype,
        "workload": {
            "prefill_lens": list(workload.prefill_lens),
            "decode_batches": list(workload.decode_batches),
            "decode_prompt_len": workload.decode_prompt_len,
            "decode_tokens": workload.decode_tokens,
            "repeats": workload.repeats,
            "max_spread": workload.max_spread,
            "max_repeats": workload.repeat_cap,
            "warmup_tokens": workload.warmup_tokens,
        },
    }
    return BenchReport(machine, settings, bandwidth, roofline, results, skipped)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def parser() -> argparse.ArgumentParser:
    """The parser of ``pdserve bench engine``."""
    p = argparse.ArgumentParser(
        prog="pdserve bench engine",
        description="Prefill and decode throughput of pdserve's engine beside HF transformers "
        "and (with --vllm-python) vLLM's CPU build, on one checkpoint.",
    )
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (HF layout)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every peer (default 2)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="a Python interpreter that can `import vllm` (e.g. /opt/vllm-venv/bin/python)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats per case; medians are reported"
    )
    p.add_argument(
        "--max-spread",
        type=float,
        default=0.25,
        help="repeat a case, a round at a time, while some peer's samples spread wider than "
        "this ((max - min) / median; default 0.25)",
    )
    p.add_argument(
        "--max-repeats",
        type=int,
        default=0,
        help="rounds a wide case may grow to (0: 2x --repeats)",
    )
    p.add_argument("--prefill-lens", type=_int_list, default=(1024, 4096), help="default 1024,4096")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        metavar="TOKENS",
        help="also time pdserve prefilling in chunks of this many tokens (its step budget), "
        "beside its one-shot prefill (default 0: not measured)",
    )
    p.add_argument("--decode-batches", type=_int_list, default=(1, 8, 32), help="default 1,8,32")
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument(
        "--membw-mib", type=int, default=DEFAULT_BYTES // 2**20, help="bandwidth test size"
    )
    p.add_argument(
        "--max-load",
        type=float,
        default=1.0,
        help="1-minute load average above which the run waits (see --wait-minutes)",
    )
    p.add_argument(
        "--wait-minutes",
        type=float,
        default=0.0,
        help="wait up to this long for the load to drop below --max-load (default: don't)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every number to this file")
    p.add_argument("--quiet", action="store_true", help="print only the table")
    return p


def main(argv: Sequence[str]) -> int:
    """Entry of ``pdserve bench engine``."""
    args = parser().parse_args(list(argv))

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    workload = Workload(
        prefill_lens=args.prefill_lens,
        decode_batches=args.decode_batches,
        decode_prompt_len=args.decode_prompt_len,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        max_spread=args.max_spread,
        max_repeats=args.max_repeats,
    )
    wait_for_quiet(args.max_load, args.wait_minutes * 60.0, log)
    report = run_bench(
        args.model,
        workload=workload,
        threads=args.threads,
        dtype=args.dtype,
        include_hf=not args.no_hf,
        vllm_python=args.vllm_python,
        prefill_chunk=args.prefill_chunk,
        membw_bytes=args.membw_mib * 2**20,
        log=log,
    )
    print(report.table())
    m = report.machine
    print(f"pdserve engine: {m.get('pdserve_config', '-')}")
    print(f"1-minute load: {m['load_1min_start']} at start, {m['load_1min_end']} at end")
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0
