"""The report of ``pdserve bench transfer`` (definitions in ``docs/benchmarks.md``)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve_bench.transfer_paired import Pair, PairedPoint, summarize
from pdserve_bench.transfer_refs import References
from pdserve_bench.transfer_sample import Sample, link_bytes_per_s


def peak_and_average(spans: Sequence[tuple[int, int, int]]) -> tuple[float, float]:
    """Aggregate bytes/s of transfers ``(start_ns, end_ns, bytes)`` running together: the
    peak (each spread evenly over its span, summed where they overlap) and the average
    (all bytes over the whole window)."""
    spans = [s for s in spans if s[1] > s[0]]
    if not spans:
        return 0.0, 0.0
    events = sorted({t for s in spans for t in s[:2]})
    peak = max(sum(b / ((e - s) / 1e9) for s, e, b in spans if s <= t < e) for t in events[:-1])
    window = (max(s[1] for s in spans) - min(s[0] for s in spans)) / 1e9
    return peak, sum(s[2] for s in spans) / window


def _of_references(x: Sample, ref: References) -> tuple[str, str]:
    """The transport's bandwidth (its slower side; direct: the send, its read is in-process)
    against memcpy (shm) or loopback TCP, and against raw gRPC, as measured at their best in
    the run (``ref``): the ratios of runs recorded before the paired rounds
    (``transfer_paired``)."""
    bw = link_bytes_per_s(x.transport, x.send_span_bytes_per_s, x.recv_bytes_per_s)
    if x.transport == "shm":
        return f"{bw / ref.memcpy:.0%}", "-"
    return f"{bw / ref.tcp:.0%}", f"{bw / ref.grpc:.0%}"


def _rates(base: Sample, ref: References, point: PairedPoint | None) -> str:
    """The send, recv, of-reference and of-raw-gRPC cells: from the paired rounds where
    there are some, else from the sample against the run's best references."""
    gb = 1e9
    if point is None:
        send, recv = base.send_span_bytes_per_s, base.recv_bytes_per_s
        of_ref, of_grpc = _of_references(base, ref)
    else:
        send, recv, of_ref = point.send_bytes_per_s, point.recv_bytes_per_s, point.ratio_text
        of_grpc = "-" if point.grpc_ratio is None else f"{point.grpc_ratio:.0%}"
    # direct: assembled as it landed; the read only hands the payload over.
    recv_text = "on arrival" if base.transport == "direct" else f"{recv / gb:.2f}"
    return f"{send / gb:.2f} | {recv_text} | {of_ref} | {of_grpc}"


def report(
    samples: Sequence[Sample],
    bursts: dict[str, dict[str, float]],
    ref: References,
    pairs: Sequence[Pair] = (),
) -> str:
    """The results as markdown tables (definitions in ``docs/benchmarks.md``)."""
    gb = 1e9
    points = summarize(pairs)
    rounds = max((x.rounds for x in points.values()), default=0)
    how = (
        f"rates and ratios: the median of {rounds} paired rounds (the range of the ratio in "
        "brackets), each hand-off against its reference measured right before and after it"
        if points
        else "ratios against the run's best references"
    )
    lines = [
        f"References (the run's best, before and after it): {ref.summary()}; {how}.",
        "",
        "| transport | tokens | KV MB | send GB/s | recv GB/s | of memcpy / TCP | of raw gRPC "
        "| TTFT ms | visible ms, layer-wise / deferred | share of TTFT, layer-wise / deferred "
        "| hidden |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def find(t: str, n: int, layerwise: bool) -> Sample | None:
        return next(
            (x for x in samples if (x.transport, x.tokens, x.layerwise) == (t, n, layerwise)), None
        )

    for t in dict.fromkeys(x.transport for x in samples):
        for n in dict.fromkeys(x.tokens for x in samples):
            lw, de = find(t, n, True), find(t, n, False)
            point = points.get((t, n))
            if lw is None and de is not None and de.reused:  # bandwidth only: no compute
                lines.append(
                    f"| {t} | {n} | {de.num_bytes / 1e6:.0f} | {_rates(de, ref, point)} | "
                    f"(reused prefill) | - / {de.visible_ms:.0f} | - | - |"
                )
                continue
            if lw is None:
                continue
            if t == "recompute":
                lines.append(
                    f"| recompute | {n} | - | - | - | - | - | {lw.prefill_rpc_ms:.0f} | "
                    f"{lw.recompute_ms:.0f} (decode-side prefill) | "
                    f"{lw.recompute_ms / lw.ready_ms:.0%} | - |"
                )
                continue
            base = de or lw  # link rates from the no-overlap run: not paced by the compute
            visible = f"{lw.visible_ms:.0f} / {de.visible_ms:.0f}" if de else f"{lw.visible_ms:.0f}"
            share = f"{lw.share:.1%} / {de.share:.1%}" if de else f"{lw.share:.1%}"
            hidden = f"{1 - lw.visible_ms / de.visible_ms:.0%}" if de and de.visible_ms else "-"
            lines.append(
                f"| {t} | {n} | {lw.num_bytes / 1e6:.0f} | {_rates(base, ref, point)} | "
                f"{lw.prefill_rpc_ms:.0f} | {visible} | {share} | {hidden} |"
            )
    metered = [x for x in points.values() if x.cpu_s_per_gb is not None or x.latency_ms]
    if metered:
        lines += [
            "",
            "The paired rounds' hand-offs, one at a time: every service process's CPU seconds "
            "per GB moved (the whole hand-off on both sides, its two model steps included) and "
            "the latency from the first byte sent to the KV checked:",
            "",
            "| transport | tokens | CPU s/GB | latency p50 / p99 ms |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {x.transport} | {x.tokens} | "
            f"{'-' if x.cpu_s_per_gb is None else f'{x.cpu_s_per_gb:.2f}'} | "
            f"{'-' if x.latency_ms is None else f'{x.latency_ms[0]:.1f} / {x.latency_ms[1]:.1f}'} |"
            for x in metered
        ]
    cold = [x for x in samples if not x.layerwise and x.first_visible_ms >= 0]
    if cold:
        lines += [
            "",
            "First hand-off of each size (its buffers fault in) against the kept run, deferred:",
            "",
            "| transport | tokens | first run visible ms | kept run visible ms |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {x.transport} | {x.tokens} | {x.first_visible_ms:.0f} | {x.visible_ms:.0f} |"
            for x in cold
        ]
    if bursts:
        lines += [
            "",
            "| transport | send peak GB/s | send average | recv peak | recv average "
            "| latency p50 / p99 ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for t, b in bursts.items():
            received = (
                "on arrival | on arrival"
                if t.startswith("direct")
                else f"{b['recv_peak'] / gb:.2f} | {b['recv_avg'] / gb:.2f}"
            )
            latency = (
                f"{b['latency_p50_ms']:.0f} / {b['latency_p99_ms']:.0f}"
                if "latency_p50_ms" in b
                else "-"
            )
            lines.append(
                f"| {t} | {b['send_peak'] / gb:.2f} | {b['send_avg'] / gb:.2f} | {received} | "
                f"{latency} |"
            )
    return "\n".join(lines)
