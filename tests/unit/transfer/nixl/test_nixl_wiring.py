"""``--transport nixl`` at start (refused without NIXL, naming the extra; refused on the sim
backend), the nixl handle through the protocol, and a worker's heartbeat publishing its
agent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pdserve.convert.kv import handle_from_proto, handle_to_proto
from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.transfer.base import KVLocation, TransportKind
from pdserve.transfer.nixl.agent import AgentDescriptor, nixl_available
from pdserve.v1 import common_pb2
from pdserve.worker.options import options_from_args, worker_parser


def options(*flags: str):  # type: ignore[no-untyped-def]
    parser = worker_parser("w", None, roles=[WorkerRole.PREFILL], default_max_wait_ms=0.0, env={})
    return options_from_args(parser.parse_args(["--model", "/m", "--kvstore", "h:1", *flags]))


def test_without_nixl_the_transport_is_refused_naming_the_extra() -> None:
    # A real failed import: the child cannot find the NIXL modules.
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("nixl", "nixl_cu12"):
                    raise ImportError(f"no module named {name}")
                return None
        sys.meta_path.insert(0, Hide())
        from pdserve.errors import InvalidArgumentError
        from pdserve.scheduling.worker_info import WorkerRole
        from pdserve.worker.options import options_from_args, worker_parser
        p = worker_parser("w", None, roles=[WorkerRole.PREFILL], default_max_wait_ms=0, env={})
        for flags in (["--transport", "nixl"], ["--nixl-pool-bytes", "1048576"]):
            try:
                options_from_args(p.parse_args(["--model", "/m", "--kvstore", "h:1", *flags]))
            except InvalidArgumentError as err:
                print(err.field, "|", err)
            else:
                print("accepted")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert len(out) == 2
    for line in out:
        assert line.startswith("--transport |") and "pdserve[nixl]" in line


def test_the_sim_backend_refuses_nixl() -> None:
    with pytest.raises(InvalidArgumentError, match="sim backend") as err:
        options(
            "--backend", "sim", "--sim-profile", "roofline:h100:llama-3-8b", "--transport", "nixl"
        )
    assert err.value.field == "--transport"


def test_a_pool_must_hold_a_block_of_whole_pages() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        options("--transport", "nixl", "--nixl-block-bytes", "1000")
    assert err.value.field == "--nixl-block-bytes"
    with pytest.raises(InvalidArgumentError) as err:
        options("--transport", "nixl", "--nixl-pool-bytes", "4096")
    assert err.value.field == "--nixl-pool-bytes"


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pdserve[nixl])")
def test_with_nixl_the_transport_is_accepted_and_sizes_its_pool() -> None:
    o = options("--transport", "nixl").transfer_options()
    assert o.transports == (TransportKind.NIXL,) and o.nixl_pool == 256 * 1024 * 1024
    assert options("--nixl-pool-bytes", str(8 << 20)).transfer_options().nixl_pool == 8 << 20
    assert options().transfer_options().nixl_pool == 0  # no pool unless asked for


def test_a_nixl_handle_round_trips_and_its_missing_fields_are_named() -> None:
    loc = KVLocation(
        TransportKind.NIXL, "r", 40, 4096, "fp", address="agent-a", key="f" * 32,
        host="node-a", length=4000, blocks=(3, 4, 9), capability=bytes(range(16)),
    )  # fmt: skip
    assert handle_from_proto(handle_to_proto(loc)) == loc
    for field in ("agent", "metadata_fingerprint", "blocks"):
        handle = handle_to_proto(loc)
        handle.nixl.ClearField(field)
        with pytest.raises(InvalidArgumentError) as err:
            handle_from_proto(handle)
        assert err.value.field == f"kv.nixl.{field}"
    bare = handle_to_proto(loc)
    bare.ClearField("capability")
    with pytest.raises(InvalidArgumentError, match="capability"):
        handle_from_proto(bare)
    assert isinstance(handle_to_proto(loc), common_pb2.KVHandle)


def test_a_heartbeat_carries_the_agent_and_its_fingerprint() -> None:
    d = AgentDescriptor("agent-a", b"meta", 4096, 8192, 4, 4096)
    info = WorkerInfo(
        id="p0", role=WorkerRole.PREFILL, address="h:1", host="h", model_fingerprint="m",
        kv_blocks_total=1, kv_blocks_free=1, block_size=16, max_batch_tokens=8,
        kv_agent=d.encode(), kv_agent_fingerprint=d.fingerprint,
    )  # fmt: skip
    back = WorkerInfo.from_json(info.to_json())
    assert AgentDescriptor.decode(back.kv_agent) == d
    assert back.kv_agent_fingerprint == d.fingerprint
