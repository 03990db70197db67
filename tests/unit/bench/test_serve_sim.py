"""`bench serve` on sim clusters: the backend options, the sim flags each cluster's workers
get, the refusals, and the run in modelled time (``--sim-time-scale``) on synthetic records."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve_bench.serve import sweep
from pdserve_bench.serve.cli import main, parser
from pdserve_bench.serve.cli_targets import (
    DEFAULT_SIM_LINK,
    DEFAULT_SIM_PROFILE,
    cluster_spec,
    labels,
    make_targets,
    time_scale_of,
)
from pdserve_bench.serve.metrics import Slo
from pdserve_bench.serve.mixes import SHORT_ONLY
from pdserve_bench.serve.records import RequestRecord, Status
from pdserve_bench.serve.report import format_report
from pdserve_bench.serve.settings import settings
from pdserve_bench.serve.timescale import TimeScale
from pdserve_bench.serve.workload import Load, PointPlan

from .fakes import FakeTarget

SIM_FLAGS = (
    f"--sim-profile={DEFAULT_SIM_PROFILE}",
    "--sim-time-scale=1.0",
    f"--sim-link={DEFAULT_SIM_LINK}",
)


def test_defaults_are_those_of_pdserve_up_and_the_sim_worker() -> None:
    from pdserve.sim.backend import DEFAULT_LINK
    from pdserve.up import DEFAULT_SIM_PROFILE as UP_PROFILE

    assert (DEFAULT_SIM_PROFILE, DEFAULT_SIM_LINK) == (UP_PROFILE, DEFAULT_LINK)


def test_global_and_per_cluster_backends(tmp_path: Path) -> None:
    args = parser().parse_args(
        ["--model", str(tmp_path), "--backend", "sim", "--threads", "2",
         "--sim-profile", "roofline:h100:llama-3-8b:tp2", "--sim-link", "nvlink",
         "--config", "conditional", "--workers", "2:2",
         "--config", "conditional", "--workers", "2:2", "--target-backend", "torch"]
    )  # fmt: skip
    sim, torch = (cluster_spec(args, t.value, t) for t in args.targets)
    assert sim.backend == "sim" and torch.backend == "torch"
    assert sim.worker_args == (
        "--dtype", "bfloat16", "--sim-profile=roofline:h100:llama-3-8b:tp2",
        "--sim-time-scale=1.0", "--sim-link=nvlink",
    )  # fmt: skip
    assert torch.worker_args == ("--dtype", "bfloat16", "--threads", "2")
    assert sim.to_json()["backend"] == "sim" and torch.to_json()["backend"] == "torch"
    assert labels(args) == ["pdserve-conditional-2p2m-sim", "pdserve-conditional-2p2m"]
    # The other way round: torch by default, one cluster on sim; its own flags come last.
    args = parser().parse_args(
        ["--model", str(tmp_path), "--worker-arg=--max-num-seqs=8",
         "--config", "colocated", "--target-backend", "sim", "--target-worker-arg=--kv-blocks=64",
         "--config", "disaggregated"]
    )  # fmt: skip
    sim, torch = (cluster_spec(args, t.value, t) for t in args.targets)
    assert (sim.backend, torch.backend) == ("sim", "torch")
    assert sim.worker_args == (
        "--dtype", "bfloat16", *SIM_FLAGS, "--max-num-seqs=8", "--kv-blocks=64",
    )  # fmt: skip
    assert not any(a.startswith("--sim-") for a in torch.worker_args)
    assert labels(args) == ["pdserve-colocated-2w-sim", "pdserve-disaggregated-1p1d"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--router", "r:1", "--target-backend", "sim"],  # after a router, not a cluster
        ["--config", "conditional", "--target-backend", "tensorrt-llm"],
        ["--backend", "gpu", "--config", "conditional"],
    ],
)
def test_bad_backend_options_exit_with_a_message(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


class FakeCluster:
    """Stands in for ``pdserve.launcher.Cluster``: keeps what it was asked for."""

    made: list[dict[str, Any]] = []

    def __init__(self, model_dir: Path, **kwargs: Any) -> None:
        FakeCluster.made.append({"model_dir": model_dir, **kwargs})
        self.router_address = f"127.0.0.1:{5000 + len(FakeCluster.made)}"
        self.services: list[Any] = []  # no processes: describe() reports no memory

    def __enter__(self) -> FakeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_make_targets_starts_each_cluster_on_its_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdserve.launcher

    monkeypatch.setattr(pdserve.launcher, "Cluster", FakeCluster)
    FakeCluster.made = []
    args = parser().parse_args(
        ["--model", str(tmp_path), "--backend", "sim", "--sim-time-scale", "3",
         "--config", "conditional", "--config", "disaggregated", "--label", "d"]
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        targets = make_targets(args, stack, lambda _m: None)
    assert [t.label for t in targets] == ["pdserve-conditional-1p1m-sim", "d"]
    for made in FakeCluster.made:
        assert made["backend"] == "sim"
        assert "--sim-time-scale=3.0" in made["worker_args"]
    assert targets[0].describe()["cluster"]["backend"] == "sim"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--backend", "sim", "--sim-profile", "roofline:h100:no-such-model"], "--sim-profile"),
        (["--backend", "sim", "--sim-profile", "warp-drive"], "--sim-profile"),
        (["--backend", "sim", "--sim-link", "carrier-pigeon"], "--sim-link"),
        (["--backend", "sim", "--sim-time-scale", "0"], "--sim-time-scale"),
        (["--backend", "sim", "--sim-time-scale", "-2"], "--sim-time-scale"),
        (["--sim-time-scale", "2"], "--sim-time-scale"),  # no sim cluster to scale
    ],
)
def test_bad_sim_values_are_refused_naming_the_flag(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path), "--vocab-size", "1000", *argv, "--config", "conditional"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"error: {flag}:" in err


@pytest.mark.parametrize(
    "other",
    [
        ["--config", "colocated", "--target-backend", "torch"],
        ["--router", "r:1"],
        ["--openai-url", "http://h:1"],
    ],
)
def test_scaled_sim_beside_a_real_time_target_is_refused(
    other: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tmp_path), "--vocab-size", "1000", "--backend", "sim",
            "--sim-time-scale", "2",
            "--config", "conditional", *other]  # fmt: skip
    with pytest.raises(InvalidArgumentError, match=r"--sim-time-scale.*real time"):
        time_scale_of(parser().parse_args(argv))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "error: --sim-time-scale:" in capsys.readouterr().err
    # Unscaled, the sim cluster runs in real time: it may sit beside anything.
    unscaled = [a for a in argv if a not in ("--sim-time-scale", "2")]
    assert time_scale_of(parser().parse_args(unscaled)).is_real


def test_settings_carry_the_time_scale_and_say_so(tmp_path: Path) -> None:
    s = settings(
        parser().parse_args(
            ["--model", str(tmp_path), "--vocab-size", "1000", "--backend", "sim",
             "--sim-time-scale", "2", "--config", "conditional", "--rates", "4",
             "--ttft-slo", "1.5", "--itl-slo", "150ms"]
        )
    )  # fmt: skip
    assert s.time_scale == TimeScale(2.0)
    assert s.rates == [4.0] and (s.slo.ttft_s, s.slo.itl_s) == (1.5, 0.15)  # as given: modelled
    assert s.headline().splitlines()[1] == (
        "sim time scale 2: rates and latencies are in modelled time; real rates were 1/2"
    )
    assert s.to_json()["time_scale"] == 2.0
    plain = settings(parser().parse_args(["--router", "r:1", "--vocab-size", "1000"]))
    assert plain.time_scale.is_real and len(plain.headline().splitlines()) == 1


def test_a_plan_is_sent_stretched_and_its_records_come_back_in_modelled_time() -> None:
    plan = Load(1000, mix=SHORT_ONLY, num_requests=40, warmup=2).plan(4.0)
    real = TimeScale(2.0).real_plan(plan)
    assert real.rate == 4.0  # the point keeps its modelled rate
    assert [r.arrival_s for r in real.requests] == [2 * r.arrival_s for r in plan.requests]
    assert [r.prompt for r in real.requests] == [r.prompt for r in plan.requests]
    rec = RequestRecord(0, "short", False, 1.0, 3, send_s=1.5, chunk_s=[4.0, 4.2, 4.6],
                        chunk_tokens=[1, 1, 1], end_s=5.0, status=Status.OK)  # fmt: skip
    (out,) = TimeScale(2.0).modelled_records([rec])
    assert (out.scheduled_s, out.send_s, out.chunk_s, out.end_s) == (
        0.5,
        0.75,
        [2.0, 2.1, 2.3],
        2.5,
    )
    assert (out.ttft_s, out.e2e_s) == (1.25, 1.75) and out.output_tokens == 3
    assert rec.chunk_s == [4.0, 4.2, 4.6] and rec.ttft_s == 2.5  # the original is kept
    assert TimeScale().real_plan(plan) is plan


REAL_TTFT_S = 2.5
REAL_GAP_S = 0.2


def _fake_run_point(sent: list[tuple[PointPlan, float]]) -> Any:
    """A ``run_point`` that sends nothing: each request is 'sent' on schedule and answered
    with a TTFT of ``REAL_TTFT_S`` and chunks ``REAL_GAP_S`` apart, in real seconds."""

    async def run_point(target: Any, plan: PointPlan, *, request_timeout_s: float,
                        on_change: Any = None) -> list[RequestRecord]:  # fmt: skip
        sent.append((plan, request_timeout_s))
        out = []
        for req in plan.requests:
            rec = RequestRecord.planned(req)
            first = req.arrival_s + REAL_TTFT_S
            rec.send_s = req.arrival_s
            rec.chunk_s = [first + i * REAL_GAP_S for i in range(req.output_tokens)]
            rec.chunk_tokens = [1] * req.output_tokens
            rec.end_s = rec.chunk_s[-1]
            rec.status = Status.OK
            out.append(rec)
        return out

    return run_point


@pytest.mark.parametrize(
    ("k", "good", "ttft", "itl_ms"),
    [
        (1.0, "0.00", "2.50", "200"),  # real time: TTFT 2.5 s > 1.5 s, gaps 200 ms > 150 ms
        (2.0, "1.00", "1.25", "100"),  # judged against 3 s and 300 ms; shown halved
    ],
)
def test_rates_offered_slo_judged_and_latencies_reported_in_modelled_time(
    k: float, good: str, ttft: str, itl_ms: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[PointPlan, float]] = []
    monkeypatch.setattr(sweep, "run_point", _fake_run_point(sent))
    load = Load(1000, mix=SHORT_ONLY, num_requests=20, warmup=1)
    slo, scale = Slo(ttft_s=1.5, itl_s=0.150), TimeScale(k)
    target = FakeTarget("sim")
    result = asyncio.run(
        sweep.run_all([target], load, rates=[4.0], search=None, slo=slo,
                      request_timeout_s=60.0, time_scale=scale)
    )  # fmt: skip
    ((plan, timeout),), (point,) = sent, result.points
    # Offered: the same requests, k times later (real rate 4 / k); the timeout k times longer.
    assert [r.arrival_s for r in plan.requests] == [
        k * r.arrival_s for r in load.plan(4.0).requests
    ]
    assert timeout == 60.0 * k and point.rate == 4.0 and target.rates == [4.0]
    s = point.summary
    assert s.ttft is not None and s.ttft.p50 == pytest.approx(REAL_TTFT_S / k)
    assert s.itl is not None and s.itl.p99 == pytest.approx(REAL_GAP_S / k)
    assert s.goodput == float(good)
    row = next(ln for ln in format_report(result, [target], slo=slo, headline="H").splitlines()
               if ln.startswith("| 4 "))  # fmt: skip
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert (cells[0], cells[6], cells[7]) == ("4", good, ttft)
    assert float(cells[10]) == pytest.approx(float(itl_ms), abs=0.05)  # ITL p50, ms
