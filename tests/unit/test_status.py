"""``pdserve status``'s table: one row per worker, its KV link bandwidth among the columns."""

from __future__ import annotations

from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.status import format_workers, kv_rate


def _worker(worker_id: str, **overrides: object) -> WorkerInfo:
    return WorkerInfo(
        id=worker_id, role=WorkerRole.PREFILL, address="10.0.0.1:5000", host="a",
        model_fingerprint="fp", kv_blocks_total=100, kv_blocks_free=60, block_size=16,
        max_batch_tokens=512, ts=100.0, **overrides,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_kv_column_shows_average_and_peak_in_mb_per_s() -> None:
    metered = _worker("p0", kv_bytes_per_s=5_000_000.0, kv_peak_bytes_per_s=512_340_000.0)
    assert kv_rate(metered) == "5.0/512.3"
    assert kv_rate(_worker("old")) == "-"  # an older heartbeat: no figures


def test_the_table_has_a_kv_column_under_its_heading() -> None:
    lines = format_workers(
        [_worker("p0", kv_bytes_per_s=5e6, kv_peak_bytes_per_s=5e8), _worker("p1")], now=102.5
    )
    header, first, second = lines
    column = header.index("KV MB/s AVG/PEAK")
    end = column + len("KV MB/s AVG/PEAK")
    assert first[column:end].strip() == "5.0/500.0"
    assert second[column:end].strip() == "-"
    assert "60/100" in first and "2.5s" in first
