"""``WorkerOptions`` declared once: each field is exactly one flag of the worker parser, the
parser's defaults are the declared ones, ``to_args`` round-trips through the parser, and the
options are checked when made, naming the flag."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.security.options import INSECURE
from pdserve.settings import flags_for, settings
from pdserve.worker.options import WorkerOptions, options_from_args, worker_parser
from pdserve.worker.scheduling_options import SchedulingOptions

PREFILL = [WorkerRole.PREFILL]
NOT_SETTINGS = {"security", "scheduling"}  # their own flags: security's, nested settings
OTHER_FLAGS = {"help", "log_level", "tls_cert", "tls_key", "tls_ca", "tls_client_auth",
               "tls_server_name", "internal_token_file", "internal_identity",
               "reflection"}  # fmt: skip


def parse(*flags: str, env: dict[str, str] | None = None) -> WorkerOptions:
    parser = worker_parser("w", None, roles=PREFILL, default_max_wait_ms=50.0, env=env or {})
    return options_from_args(parser.parse_args(list(flags)), env or {})


def test_every_field_is_exactly_one_flag() -> None:
    parser = worker_parser("w", None, roles=PREFILL, default_max_wait_ms=0.0, env={})
    dests = [a.dest for a in parser._actions]
    names = [s.name for s in settings(WorkerOptions)]
    fields = {f.name for f in dataclasses.fields(WorkerOptions)}
    nested = {f.name for f in dataclasses.fields(SchedulingOptions)}
    assert set(names) == (fields - NOT_SETTINGS) | nested
    assert sorted(names) == sorted(d for d in dests if d not in OTHER_FLAGS)
    flags = [o for a in parser._actions if a.dest in names for o in a.option_strings]
    assert len(flags) == len(set(flags)) == len(names) + 1  # --kv-store: --kvstore's alias


def test_the_parser_defaults_are_the_declared_ones() -> None:
    declared = WorkerOptions(
        model=Path("/m"), role=WorkerRole.PREFILL, kvstore="h:1", max_wait_ms=50.0
    )
    assert declared.host_name == socket.gethostname()
    assert declared.security == INSECURE and declared.scheduling == SchedulingOptions()
    assert parse("--model", "/m", "--kvstore", "h:1") == declared
    assert declared.to_args() == ["--model", "/m", "--role", "prefill", "--kvstore", "h:1",
                                  "--max-wait-ms", "50.0"]  # fmt: skip


def test_to_args_round_trips_through_the_parser() -> None:
    options = dataclasses.replace(
        parse("--model", "/m", "--kvstore", "h:1"),
        port=7, port_file=Path("/tmp/p"), kv_cache_bytes=1 << 20, host_lease=Path("/l"),
        allow_shm=False, layerwise=False, prefix_reuse=True, faults=("corrupt", "stall:2@r"),
        transport="store", trtllm_kv_fraction=None, max_wait_ms=0.0,
        scheduling=SchedulingOptions(lane="short", kv_events=False, waiting_order="short_first"),
    )  # fmt: skip
    args = options.to_args()
    assert {"--no-shm", "--no-layerwise", "--prefix-reuse", "--no-kv-events"} <= set(args)
    assert args.count("--fault") == 2 and "--max-wait-ms" not in args  # 0.0: the declared one
    parser = worker_parser("w", None, roles=PREFILL, default_max_wait_ms=0.0, env={})
    assert options_from_args(parser.parse_args(args)) == options


def test_environment_defaults() -> None:
    env = {"PDSERVE_MODEL": "/m", "PDSERVE_KVSTORE": "h:1", "PDSERVE_KV_LEASE_S": "5",
           "PDSERVE_KV_EVENTS": "0", "PDSERVE_PREFIX_REUSE": "1", "PDSERVE_LANE": "long",
           "PDSERVE_LAYERWISE": "0"}  # fmt: skip
    o = parse(env=env)
    assert (o.model, o.kvstore, o.kv_lease_s, o.prefix_reuse) == (Path("/m"), "h:1", 5.0, True)
    assert (o.scheduling.kv_events, o.scheduling.lane) == (False, "long")
    assert o.layerwise  # the --no-* hand-off switches read no environment
    assert parse("--lane", "any", env=env).scheduling.lane == "any"  # the flag wins


@pytest.mark.parametrize(
    ("make", "flag"),
    [
        (lambda: WorkerOptions(model=Path("/m"), role=WorkerRole.PREFILL), "--kvstore"),
        (lambda: WorkerOptions(Path("/m"), WorkerRole.DECODE, dtype="float16"), "--dtype"),
        (lambda: WorkerOptions(Path("/m"), WorkerRole.DECODE, bulk_tokens=-1), "--bulk-tokens"),
        (
            lambda: WorkerOptions(Path("/m"), WorkerRole.DECODE, kv_blocks=1, kv_cache_bytes=1),
            "--kv-blocks",
        ),
        (lambda: WorkerOptions(Path("/m"), WorkerRole.DECODE, faults=("bogus",)), "--fault"),
        (
            lambda: parse(
                *("--model", "/m", "--kvstore", "h:1", "--backend", "sim", "--record-steps", "s"),
                *("--sim-profile", "roofline:h100:llama-3-8b"),
            ),
            "--record-steps",
        ),
        (lambda: parse("--kvstore", "h:1"), "--model"),
        # argparse checks choices on the command line only: a bad default from the environment
        # is refused when the options are made.
        (
            lambda: parse("--model", "/m", "--kvstore", "h:1", env={"PDSERVE_TRANSPORT": "pigeon"}),
            "--transport",
        ),
    ],
)
def test_checked_when_made_naming_the_flag(make: object, flag: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        make()  # type: ignore[operator]
    assert err.value.field == flag


def test_flags_for_renders_the_named_fields_only() -> None:
    flags = flags_for(WorkerOptions, backend="sim", host_lease=None, lane="long", duty="decode")
    assert flags == ["--backend", "sim", "--lane", "long", "--duty", "decode"]
    with pytest.raises(TypeError, match="no settings"):
        flags_for(WorkerOptions, colour="blue")


def test_the_engine_and_transfer_settings_are_their_configs_fields() -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.transfer.base import TransportKind
    from pdserve.transfer.compress import Compression

    o = parse(
        "--model", "/m", "--kvstore", "h:1", "--max-batch-tokens", "64", "--max-num-seqs", "2",
        "--block-size", "16", "--kv-blocks", "8", "--threads", "2", "--kv-lease-s", "7",
        "--network-transport", "store", "--kv-compression", "int8", "--no-kv-prefetch",
    )  # fmt: skip
    config = o.engine_config()  # every engine setting set: an unknown name fails below
    engine = EngineConfig(**config)
    assert (engine.max_num_batched_tokens, engine.num_kv_blocks, engine.num_threads) == (64, 8, 2)
    assert (engine.waiting_order, engine.dtype) == ("fcfs", "auto")
    assert "num_kv_blocks" not in parse("--model", "/m", "--kvstore", "h:1").engine_config()
    t = o.transfer_options()
    assert (t.network, t.compression) == (TransportKind.STORE, Compression.INT8)
    assert (t.lease_s, t.prefetch, t.prefetch_min_bytes) == (7.0, False, 4 << 20)
    assert (t.shm_slot_bytes, t.nixl_block_bytes, t.faults) == (1 << 30, 64 << 10, None)
