"""What is particular to the shm transport: names, handles, corruption, and a real engine."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidArgumentError,
    KVTransferError,
)
from pdserve.transfer.base import KVLocation, TransferState
from pdserve.transfer.janitor import SHM_DIR, SegmentState, segment_state
from pdserve.transfer.shm import segment
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.writer import SegmentWriter
from tests.unit.engine.test_parity import prompts_of, run_collect
from tests.unit.transfer.conftest import (
    assert_same_payload,
    leftovers,
    make_layout,
    random_payload,
)


def sealed(prefix: str, rid: str = "r", num_tokens: int = 6) -> tuple[KVLocation, KVPayload]:
    payload = random_payload(make_layout(num_layers=3), num_tokens)
    sender = SegmentWriter(prefix=prefix)
    sender.begin(rid, payload.layout, num_tokens)
    for i in range(3):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    return sender.finish(), payload


def test_descriptor_names_the_segment(shm_prefix: str) -> None:
    desc, _ = sealed(shm_prefix)
    assert re.fullmatch(rf"{re.escape(shm_prefix)}{os.getpid()}-[0-9a-f]{{16}}", desc.key)
    assert leftovers(shm_prefix) == [desc.key]
    assert (SHM_DIR / desc.key).stat().st_size == desc.length == desc.num_bytes
    assert desc.offset == 0 and desc.host


def test_a_handle_alone_is_enough(shm_prefix: str) -> None:
    # A KVHandle carries no layout and no per-layer checksums: the segment has both.
    desc, payload = sealed(shm_prefix)
    handle = desc
    got = asyncio.run(SegmentReader().receive(handle, timeout_s=5.0))
    assert_same_payload(got, payload)
    assert leftovers(shm_prefix) == []


@pytest.mark.parametrize("use_handle", [False, True])
def test_corrupt_segment_refused_and_unlinked(shm_prefix: str, use_handle: bool) -> None:
    desc, _ = sealed(shm_prefix)
    path = SHM_DIR / desc.key
    with open(path, "r+b") as f:  # flip one byte in the middle of the last layer
        f.seek(desc.length - 5)
        byte = f.read(1)
        f.seek(desc.length - 5)
        f.write(bytes([byte[0] ^ 0x40]))
    if use_handle:
        desc = desc
    receiver = SegmentReader()
    with pytest.raises(KVTransferError, match="layer 2 failed its checksum"):
        asyncio.run(receiver.receive(desc, timeout_s=5.0))
    assert receiver.state is TransferState.FAILED and leftovers(shm_prefix) == []


def test_unsealed_segment_is_left_to_its_writer(shm_prefix: str) -> None:
    payload = random_payload(make_layout(num_layers=2), 4)
    sender = SegmentWriter(prefix=shm_prefix)
    sender.begin("r", payload.layout, 4)
    early = KVLocation(sender.kind, "r", 4, 0, "", key=sender.name, capability=sender.capability)
    with pytest.raises(KVTransferError, match="not sealed"):
        asyncio.run(SegmentReader().receive(early, timeout_s=5.0))
    assert leftovers(shm_prefix) == [sender.name]
    sender.abort()
    assert leftovers(shm_prefix) == []


def test_other_host_and_bad_names_refused(shm_prefix: str) -> None:
    desc, _ = sealed(shm_prefix)
    with pytest.raises(KVTransferError, match="on host"):
        asyncio.run(SegmentReader(host="elsewhere").receive(desc, timeout_s=5.0))
    for name in ("", "../passwd", "a/b", ".."):
        bad = dataclasses.replace(desc, key=name)
        with pytest.raises(InvalidArgumentError) as err:
            asyncio.run(SegmentReader().receive(bad, timeout_s=5.0))
        assert err.value.field == "descriptor.name"
    assert leftovers(shm_prefix) == [desc.key]  # none of that touched the segment
    gone = dataclasses.replace(desc, key=f"{shm_prefix}1-0")
    with pytest.raises(KVTransferError, match="is gone"):
        asyncio.run(SegmentReader().receive(gone, timeout_s=5.0))
    asyncio.run(SegmentReader().receive(desc, timeout_s=5.0))
    assert leftovers(shm_prefix) == []


def test_duplicate_request_id(shm_prefix: str) -> None:
    desc, _ = sealed(shm_prefix, rid="same")
    again = SegmentWriter(prefix=shm_prefix)
    with pytest.raises(DuplicateRequestError):
        again.begin("same", make_layout(), 4)
    assert again.state is TransferState.FAILED
    assert leftovers(shm_prefix) == [desc.key]  # the first one is intact
    asyncio.run(SegmentReader().receive(desc, timeout_s=5.0))


def test_full_shm_is_a_capacity_error(shm_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    payload = random_payload(make_layout(num_layers=3), 4)
    sender = SegmentWriter(prefix=shm_prefix)
    # The space is reserved beside the compute (the mapper thread), so begin goes through
    # and the hooked layers are dropped; the commit reports it, and nothing is left.
    sender.begin("r", payload.layout, 4)
    for i in range(3):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    with pytest.raises(KVTransferError, match="shared memory is full") as err:
        sender.finish()
    assert isinstance(err.value.__cause__, CapacityError)
    assert sender.state is TransferState.FAILED and leftovers(shm_prefix) == []


def test_read_honours_the_deadline(shm_prefix: str) -> None:
    desc, _ = sealed(shm_prefix)
    fd = os.open(SHM_DIR / desc.key, os.O_RDONLY)
    try:
        head = segment.read_header(fd, 0, desc.key, desc.capability)
        with pytest.raises(KVTransferError, match="timed out at layer 0"):
            segment.read_payload(fd, 0, head, head.checksums, deadline=0.0)
    finally:
        os.close(fd)
    SegmentReader(host=desc.host).cleanup()  # no segment of its own yet: a no-op
    SegmentWriter(prefix=shm_prefix).abort()  # never begun: a no-op besides the state


def test_a_process_that_sends_and_receives_leaves_no_warnings(shm_prefix: str) -> None:
    # Python's resource tracker, had it seen these segments, would warn about "leaked" shared
    # memory at exit (or unlink segments another process owns). It must not be involved.
    code = f"""
import asyncio
from tests.unit.transfer.shm.test_shm import sealed
from pdserve.transfer.shm.reader import SegmentReader
desc, _ = sealed({shm_prefix!r})
asyncio.run(SegmentReader().receive(desc, timeout_s=5.0))
desc, _ = sealed({shm_prefix!r}, rid="kept-for-the-parent")
print(desc.key)
"""
    root = Path(__file__).resolve().parents[4]  # the repository: tests.* imports from there
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stderr == ""
    assert leftovers(shm_prefix) == [out.stdout.strip()]  # exit did not unlink a handed-off one


def test_engine_to_engine_over_shm(tiny_llama_dir: Path, shm_prefix: str) -> None:
    # Small batches: the 45-token prompt is prefilled in three chunks; the hook fires in the
    # last one, with the whole prompt's KV of each layer.
    a = Engine.from_pretrained(
        tiny_llama_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=32
    )
    b = Engine.from_pretrained(tiny_llama_dir, dtype="float32", block_size=8, num_kv_blocks=32)
    prompt = prompts_of(a, [45])[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = run_collect(a, [prompt], params)["r0"][0]

    sender = SegmentWriter(prefix=shm_prefix)
    sender.begin("x", a.layout, len(prompt))
    first_only = dataclasses.replace(params, max_tokens=1)
    a.add_request("x", prompt, first_only, hold_kv=True, layer_hook=sender.send_layer)
    outs = [o for _ in range(10) if a.has_unfinished() for o in a.step()]
    first = (outs[-1].new_token_ids[0], outs[-1].new_logprobs[0])
    desc = sender.finish()
    exported = a.export_kv("x")
    a.release_kv("x")
    a.check_no_leaks()

    receiver = SegmentReader(expected_layout=b.layout)
    payload = asyncio.run(receiver.receive(desc, timeout_s=5.0))
    assert_same_payload(payload, exported)
    assert leftovers(shm_prefix) == []
    b.add_request("y", prompt, params, kv=payload, first_token=first)
    tokens = [first[0]]
    while b.has_unfinished():
        tokens += [t for o in b.step() for t in o.new_token_ids]
    assert tokens == alone
    b.check_no_leaks()
    sent, got = sender.record, receiver.record
    assert sent.num_bytes == got.num_bytes == desc.length
    assert sent.first_layer_ns <= sent.last_layer_ns and got.recv_start_ns <= got.recv_end_ns


@pytest.mark.parametrize("threads", [0, 2])
def test_the_last_layer_seals_the_segment_before_finish(shm_prefix: str, threads: int) -> None:
    """A reader holds the checked KV before the prefill's commit: ``finish`` only describes
    what the last layer already sealed (the engine ends its step meanwhile)."""
    payload = random_payload(make_layout(num_layers=4), 9)
    with ThreadPoolExecutor(threads or 1) as pool:
        sender = SegmentWriter(prefix=shm_prefix, pool=pool if threads else None)
        sender.begin("r", payload.layout, 9)
        path = SHM_DIR / sender.name
        for i in range(4):
            assert segment_state(path) is not SegmentState.SEALED
            sender.send_layer(i, payload.keys[i], payload.values[i])
        assert segment_state(path) is SegmentState.SEALED
        early = sender.planned()
        got = asyncio.run(SegmentReader().receive(early, timeout_s=5.0))
        assert_same_payload(got, payload)
        descriptor = sender.finish()
    assert descriptor == early and sender.state is TransferState.SENT
    assert len(sender.checksums) == 4
    assert leftovers(shm_prefix) == []  # the reader unlinked it


def test_a_stalled_writer_leaves_the_segment_unsealed(shm_prefix: str) -> None:
    payload = random_payload(make_layout(num_layers=2), 4)
    sender = SegmentWriter(prefix=shm_prefix)
    sender.stalled = True  # the fault tests' stalled writer
    sender.begin("r", payload.layout, 4)
    for i in range(2):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    assert segment_state(SHM_DIR / sender.name) is SegmentState.WRITING
    sender.abort()
    assert leftovers(shm_prefix) == []
