"""WorkerInfo: JSON round trip and validation naming the offending field."""

from __future__ import annotations

import json

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole

from .factories import worker


def test_json_round_trip_keeps_every_field() -> None:
    info = worker(
        "decode-0",
        WorkerRole.DECODE,
        kv_blocks_free=37,
        queued_tokens=900,
        running_seqs=5,
        draining=True,
        ts=1_700_000_000.25,
        reservations=("r1", "r2"),
    )
    back = WorkerInfo.from_json(info.to_json())
    assert back == info
    assert back.role is WorkerRole.DECODE
    assert back.reservations == ("r1", "r2")


def test_json_is_plain_and_readable_by_other_tools() -> None:
    data = json.loads(worker("p0", WorkerRole.PREFILL).to_json())
    assert data["role"] == "prefill"
    assert data["kv_blocks_total"] == 100
    assert data["reservations"] == []


def test_from_json_ignores_unknown_keys_and_fills_defaults() -> None:
    data = json.loads(worker("m0", WorkerRole.MIXED).to_json())
    data["added_in_a_later_version"] = {"x": 1}
    for optional in ("queued_tokens", "running_seqs", "draining", "ts", "reservations"):
        del data[optional]
    info = WorkerInfo.from_json(json.dumps(data).encode())
    assert info.queued_tokens == 0
    assert info.draining is False
    assert info.reservations == ()


def test_kv_bandwidth_round_trips_and_is_absent_from_older_heartbeats() -> None:
    info = worker("p0", WorkerRole.PREFILL, kv_bytes_per_s=5e6, kv_peak_bytes_per_s=5e8)
    back = WorkerInfo.from_json(info.to_json())
    assert (back.kv_bytes_per_s, back.kv_peak_bytes_per_s) == (5e6, 5e8)
    older = json.loads(info.to_json())
    del older["kv_bytes_per_s"], older["kv_peak_bytes_per_s"]
    read = WorkerInfo.from_json(json.dumps(older))
    assert (read.kv_bytes_per_s, read.kv_peak_bytes_per_s) == (None, None)


def test_from_json_names_missing_fields() -> None:
    data = json.loads(worker("d0").to_json())
    del data["block_size"]
    del data["address"]
    with pytest.raises(InvalidArgumentError) as err:
        WorkerInfo.from_json(json.dumps(data))
    assert err.value.field == "heartbeat"
    assert "address" in str(err.value) and "block_size" in str(err.value)


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", b"\xff\xfe"])
def test_from_json_rejects_garbage(raw: str | bytes) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        WorkerInfo.from_json(raw)
    assert err.value.field == "heartbeat"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"role": "router"}, "role"),
        ({"kv_blocks_free": -1}, "kv_blocks_free"),
        ({"kv_blocks_free": 101}, "kv_blocks_free"),
        ({"block_size": 0}, "block_size"),
        ({"queued_tokens": 1.5}, "queued_tokens"),
        ({"draining": "yes"}, "draining"),
        ({"id": ""}, "id"),
        ({"id": "a|b"}, "id"),
    ],
)
def test_invalid_values_name_their_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        worker("w", **overrides)
    assert err.value.field == field


def test_scheduling_fields_round_trip_and_phases_follow_serves() -> None:
    info = worker(
        "m0",
        WorkerRole.MIXED,
        serves=("prefill",),
        capabilities=("prefill", "decode", "colocated"),
        lane="long",
        duty="prefill",
        step_overhead_s=0.01,
        decode_seq_s=0.001,
        prefill_token_s=0.0003,
        busy=0.4,
        links=(("node-b", "direct", 1.5e9),),
        kv_bytes_per_token=8192,
        transports=("direct", "recompute"),
    )
    back = WorkerInfo.from_json(info.to_json())
    assert back == info
    assert back.phases == ("prefill",) and back.switchable
    assert worker("d", WorkerRole.DECODE).phases == ("decode",)  # by role
    assert worker("m", WorkerRole.MIXED).phases == ("decode", "colocated")
    draining = worker("m", WorkerRole.MIXED, serves=(), switching=True, duty="decode")
    assert draining.phases == ()  # switching with nothing shared: takes nothing new
    assert not worker("p", WorkerRole.PREFILL).switchable


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"serves": ("cook",)}, "serves"),
        ({"capabilities": ("x",)}, "capabilities"),
        ({"lane": "fast"}, "lane"),
        ({"duty": "both"}, "duty"),
        ({"busy": -0.1}, "busy"),
        ({"prefill_token_s": "slow"}, "prefill_token_s"),
        ({"links": (("h", "shm"),)}, "links"),
        ({"links": (("h", "shm", 0.0),)}, "links"),
        ({"kv_bytes_per_token": -1}, "kv_bytes_per_token"),
        ({"transports": ("pigeon",)}, "transports"),
        ({"kv_bytes_per_s": -1.0}, "kv_bytes_per_s"),
        ({"kv_peak_bytes_per_s": "fast"}, "kv_peak_bytes_per_s"),
    ],
)
def test_bad_scheduling_fields_name_their_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        worker("w", **overrides)
    assert err.value.field == field
