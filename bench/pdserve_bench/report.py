"""The benchmark's report: flat metrics, the printed table and the JSON document."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve_bench.measure import CaseResult
from pdserve_bench.membw import Bandwidth, Roofline
from pdserve_bench.tables import format_table

CHUNKED = "pdserve_chunked"
"""pdserve prefilling in chunks (``bench engine --prefill-chunk``)."""
PEERS = ("pdserve", CHUNKED, "hf", "vllm")
PEER_TITLES = {"pdserve": "pdserve", CHUNKED: "pdserve chunked", "hf": "HF", "vllm": "vLLM"}


@dataclass(frozen=True, slots=True)
class Metric:
    """One table row: a value per peer (None where the peer was not measured)."""

    key: str
    """Stable name used in the JSON, e.g. ``decode_b8_tok_s``."""
    label: str
    unit: str
    values: dict[str, float | None]
    higher_is_better: bool

    def ratio(self, peer: str, mine: str = "pdserve") -> float | None:
        """``mine / peer`` (for times below 1 is better, for rates above 1 is)."""
        mine_v, theirs = self.values.get(mine), self.values.get(peer)
        if mine_v is None or theirs is None or theirs == 0:
            return None
        return mine_v / theirs


@dataclass(slots=True)
class BenchReport:
    """Everything one ``bench engine`` run measured."""

    machine: dict[str, Any]
    settings: dict[str, Any]
    bandwidth: Bandwidth
    roofline: Roofline
    results: dict[str, dict[str, CaseResult]]
    """``{peer: {case: result}}`` for the peers that ran."""
    skipped: dict[str, str] = field(default_factory=dict)
    """``{peer: why}`` for the peers that did not run."""

    def metrics(self) -> list[Metric]:
        """The table's rows, in order: prefill, decode, roofline fraction."""
        any_peer = next(iter(self.results.values()))
        rows: list[Metric] = []
        for name, res in any_peer.items():
            if res.kind == "prefill":
                n = res.prompt_len
                label = f"prefill {n} tok"
                rows.append(Metric(f"prefill_{n}_s", label, "s", self._pick(name, _seconds), False))
                rows.append(
                    Metric(f"prefill_{n}_tok_s", label, "tok/s", self._pick(name, _rate), True)
                )
        for name, res in any_peer.items():
            if res.kind == "decode":
                b = res.batch
                values = self._pick(name, _rate)
                rows.append(
                    Metric(f"decode_b{b}_tok_s", f"decode batch {b}", "tok/s", values, True)
                )
        b1 = next((m for m in rows if m.key == "decode_b1_tok_s"), None)
        if b1 is not None:
            roof = self.roofline.tokens_per_second
            frac = {p: (v / roof if v is not None else None) for p, v in b1.values.items()}
            rows.append(Metric("decode_b1_roofline_frac", "decode b1 / roofline", "x", frac, True))
        return rows

    def _pick(
        self, case: str, get: Callable[[CaseResult], float | None]
    ) -> dict[str, float | None]:
        return {p: (get(self.results[p][case]) if p in self.results else None) for p in PEERS}

    def table(self) -> str:
        """The results as a fixed-width text table (also valid Markdown). The chunked
        prefill's columns appear only where it was measured: it over one-shot."""
        chunked = CHUNKED in self.results
        peers = [p for p in PEERS if p != CHUNKED or chunked]
        head = ["metric", "unit", *(PEER_TITLES[p] for p in peers), "pdserve/HF", "pdserve/vLLM"]
        lines = [head + (["chunked/one-shot"] if chunked else [])]
        for m in self.metrics():
            lines.append(
                [
                    m.label,
                    m.unit,
                    *(_fmt(m.values.get(p)) for p in peers),
                    _fmt_ratio(m.ratio("hf")),
                    _fmt_ratio(m.ratio("vllm")),
                ]
                + ([_fmt_ratio(m.ratio("pdserve", CHUNKED))] if chunked else [])
            )
        out = format_table(lines, left_columns=2)
        roof = self.roofline
        out.append("")
        bw = self.bandwidth
        out.append(
            f"memory bandwidth: read {bw.read_gbps:.1f} GB/s, copy {bw.copy_gbps:.1f} GB/s "
            f"({bw.size_bytes / 2**20:.0f} MiB, {bw.threads} threads); "
            f"batch-1 roofline {roof.tokens_per_second:.0f} tok/s "
            f"({roof.bytes_per_token / 1e6:.1f} MB read per token)"
        )
        for peer, why in self.skipped.items():
            out.append(f"{PEER_TITLES[peer]} skipped: {why.splitlines()[0]}")
        out += self._spread_lines()
        return "\n".join(out)

    def _spread_lines(self) -> list[str]:
        """The cases repeated past ``repeats`` for a wide spread, and any still wide."""
        workload = self.settings.get("workload", {})
        repeats, limit = workload.get("repeats", 0), workload.get("max_spread", 0.0)
        lines = []
        for peer, cases in self.results.items():
            for name, r in cases.items():
                wide = bool(limit) and r.spread > limit
                if wide or (repeats and len(r.seconds) > repeats):
                    still = " (still wide)" if wide else ""
                    lines.append(
                        f"{PEER_TITLES[peer]} {name}: {len(r.seconds)} rounds, samples spread "
                        f"{r.spread:.0%}{still}"
                    )
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "settings": self.settings,
            "bandwidth": self.bandwidth.to_json(),
            "roofline": self.roofline.to_json(),
            "metrics": {
                m.key: {
                    **m.values,
                    "unit": m.unit,
                    "pdserve_over_hf": m.ratio("hf"),
                    "pdserve_over_vllm": m.ratio("vllm"),
                    "chunked_over_one_shot": m.ratio("pdserve", CHUNKED),
                }
                for m in self.metrics()
            },
            "cases": {
                p: {c: r.to_json() for c, r in cases.items()} for p, cases in self.results.items()
            },
            "skipped": self.skipped,
        }


def _seconds(r: CaseResult) -> float | None:
    return r.median_seconds


def _rate(r: CaseResult) -> float | None:
    return r.tokens_per_second


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"
