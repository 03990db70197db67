"""The decode side of nixl hand-offs: ``NixlReader`` (one per decode worker: its NIXL agent,
its registered landing blocks, the prefill agents it has loaded) and ``NixlReceiver`` (one
hand-off).

A read of one location:

1. The prefill worker's published descriptor (``AgentDirectory``: its heartbeat) is looked
   up by the handle's agent name; its fingerprint must equal both the one published beside
   it and the one the handle names, or nothing is loaded (``KVTransferError``). The agent's
   metadata is loaded once per fingerprint (a restarted worker publishes another).
2. The handle's blocks are checked against the descriptor's pool (ids inside it, as many as
   the length needs, none twice) before any descriptor is built.
3. READ the blocks' tags; each must be the handle's capability (else the blocks are not
   held for this hand-off: released, expired, or never its), then READ the blocks into this
   worker's landing blocks (one descriptor per contiguous run on both sides), then READ the
   tags again (a hand-off freed during the read is refused).
4. The payload is parsed and checked as a layer stream (``FrameCollector``: CRC-32 per layer,
   the layout against this engine's), copied out of the landing blocks, which go back.
5. The prefill agent is notified (``pool.free_message``), and frees the blocks. ``discard``
   notifies too when the read did not finish: a hand-off given up is freed at once, not at
   its lease's end.

Every transfer is polled on the event loop until it is done, failed, or the deadline passed;
one that cannot be released is left with its landing blocks (never reused), so no late write
lands in another hand-off's memory. A peer that disconnected is forgotten (its metadata is
loaded afresh next time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.kvstore.crc import fast_crc32
from pdserve.transfer.base import HandoffRecord, KVLocation, TransferState, advance
from pdserve.transfer.nixl.agent import TAG_BYTES, AgentDescriptor, fingerprint, nixl_api
from pdserve.transfer.nixl.blocks import (
    LEN_PREFIX,
    BlockAllocator,
    blocks_for,
    frames_offset,
    pair_ranges,
    ranges,
    runs,
)
from pdserve.transfer.nixl.pool import PAGE, free_message
from pdserve.transfer.stream.frames import FRAME_HEAD, FrameCollector
from pdserve.transfer.stream.header import StreamHeader

logger = logging.getLogger(__name__)

POLL_S = (0.0002, 0.002)
"""First and longest pause between polls of a transfer's state."""


class AgentDirectory(Protocol):
    """Where prefill workers publish their agents (their heartbeats)."""

    async def lookup(self, agent: str) -> tuple[str, str] | None:
        """``(descriptor, fingerprint)`` as published by ``agent``'s worker; None: unknown."""
        ...

    async def close(self) -> None: ...


class StaticDirectory:
    """An ``AgentDirectory`` of descriptors given to it (one process, or tests)."""

    def __init__(self) -> None:
        self.published: dict[str, tuple[str, str]] = {}

    def publish(self, agent: str, descriptor: str, published_fingerprint: str) -> None:
        self.published[agent] = (descriptor, published_fingerprint)

    async def lookup(self, agent: str) -> tuple[str, str] | None:
        return self.published.get(agent)

    async def close(self) -> None:
        self.published.clear()


class _GiveBack:
    """Gives landing blocks back once, from any thread."""

    def __init__(self, reader: NixlReader, blocks: Sequence[int]) -> None:
        self.reader, self.blocks = reader, list(blocks)
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        with self.reader._lock:
            self.reader.lent -= len(self.blocks)
        self.reader.give_back(self.blocks)


class NixlReader:
    """A decode worker's NIXL agent and landing blocks (see the module docstring)."""

    def __init__(
        self,
        directory: AgentDirectory,
        *,
        num_bytes: int,
        block_bytes: int,
        host: str | None = None,
        name: str | None = None,
    ) -> None:
        if block_bytes < PAGE or block_bytes % PAGE:
            raise InvalidArgumentError(
                "nixl_block_bytes", f"must be a multiple of {PAGE}, got {block_bytes}"
            )
        api = nixl_api("kv.nixl")
        self.directory = directory
        self.host = host or socket.gethostname()
        self.name = name or f"pdserve-decode-{self.host}-{secrets.token_hex(6)}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        n = max(1, num_bytes // block_bytes)
        self._mem = torch.zeros(n * block_bytes, dtype=torch.uint8)
        self._registration = self.agent.register_memory(self._mem)
        self.base = self._mem.data_ptr()
        self.data = self._mem.numpy()
        self.block_bytes = block_bytes
        self.allocator = BlockAllocator(n)
        self.lost: list[int] = []
        """Landing blocks of transfers that could not be released: never reused."""
        self.lent = 0
        """Landing blocks that received payloads lie in, until the engine imported them."""
        self._lock = threading.Lock()
        self._peers: dict[str, str] = {}  # agent name -> fingerprint of the loaded metadata
        self._closed = False

    async def peer(self, location: KVLocation) -> AgentDescriptor:
        """The descriptor of the location's agent, loaded (step 1 of the module docstring)."""
        agent, expected = location.address, location.key
        found = await self.directory.lookup(agent)
        if found is None:
            raise KVTransferError(f"NIXL agent {agent!r} publishes no descriptor (gone?)")
        text, published = found
        actual = fingerprint(text)
        if actual != published or actual != expected:
            which, named = (
                ("published with it", published)
                if actual != published
                else ("the handle names", expected)
            )
            raise KVTransferError(
                f"NIXL agent {agent!r}: its published metadata (fingerprint {actual}) does not "
                f"match the fingerprint {which} ({named})"
            )
        descriptor = AgentDescriptor.decode(text)
        if descriptor.agent != agent:
            raise KVTransferError(f"descriptor published for {agent!r} names {descriptor.agent!r}")
        if self._peers.get(agent) != actual:
            if agent in self._peers:
                self.forget(agent)
            loaded = self.agent.add_remote_agent(descriptor.metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != agent:
                self.agent.remove_remote_agent(name)
                raise KVTransferError(f"metadata published for {agent!r} is agent {name!r}")
            self._peers[agent] = actual
        return descriptor

    def forget(self, agent: str) -> None:
        """Drop a peer's loaded metadata (it disconnected, or published anew)."""
        if self._peers.pop(agent, None) is not None:
            try:
                self.agent.remove_remote_agent(agent)
            except Exception as err:  # the agent is gone either way; say so
                logger.warning("NIXL: removing agent %s: %s", agent, err)

    async def read(
        self,
        agent: str,
        remote: Sequence[tuple[int, int]],
        local_blocks: Sequence[int],
        deadline: float,
    ) -> np.ndarray:
        """READ ``remote`` ranges into ``local_blocks`` (in order) before ``deadline``
        (monotonic); the landed bytes, contiguous (a view when the blocks are one run, else
        a copy)."""
        total = sum(n for _, n in remote)
        local = ranges(local_blocks, self.base, self.block_bytes, total)
        pairs = pair_ranges(local, remote)
        ld = np.array([(a, n, 0) for (a, n), _ in pairs], dtype=np.uint64)
        rd = np.array([(a, n, 0) for _, (a, n) in pairs], dtype=np.uint64)
        await self._transfer(agent, ld, rd, local_blocks, deadline)
        if len(runs(local_blocks)) == 1:
            start = local_blocks[0] * self.block_bytes
            return self.data[start : start + total]
        return np.concatenate([self.data[a - self.base : a - self.base + n] for a, n in local])

    async def _transfer(
        self, agent: str, ld: np.ndarray, rd: np.ndarray, local: Sequence[int], deadline: float
    ) -> None:
        handle: Any = None
        done = False
        try:
            try:
                handle = self.agent.initialize_xfer(
                    "READ",
                    self.agent.get_xfer_descs(ld, "DRAM"),
                    self.agent.get_xfer_descs(rd, "DRAM"),
                    agent,
                )
                state = self.agent.transfer(handle)
                pause = POLL_S[0]
                while state == "PROC":
                    if time.monotonic() >= deadline:
                        raise KVTransferError(f"NIXL read from {agent!r} passed its deadline")
                    await asyncio.sleep(pause)  # polls the transfer; NIXL has no awaitable
                    pause = min(pause * 2, POLL_S[1])
                    state = self.agent.check_xfer_state(handle)
            except KVTransferError:
                raise
            except Exception as err:  # NIXL's own errors (not found, disconnected, ...)
                self.forget(agent)
                raise KVTransferError(f"NIXL read from {agent!r} failed: {err!r}") from err
            if state != "DONE":
                self.forget(agent)
                raise KVTransferError(f"NIXL read from {agent!r} ended in {state}")
            done = True
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception as err:
                    if not done:  # may still write there: never hand these blocks out again
                        self.lost.extend(local)
                    logger.error("NIXL: releasing a read from %s failed: %r", agent, err)

    def lend(self, payload: KVPayload, blocks: Sequence[int]) -> KVPayload:
        """``payload``, whose tensors lie in ``blocks``, with a ``release`` that gives them
        back: called by the engine's import, else when the payload's tensors are gone."""
        once = _GiveBack(self, blocks)
        with self._lock:
            self.lent += len(blocks)
        weakref.finalize(payload.keys[0], once)
        return dataclasses.replace(payload, release=once)

    def notify_free(self, agent: str, capability: bytes) -> None:
        """Tell ``agent`` the hand-off is read (or given up): it frees the blocks."""
        self.agent.send_notif(agent, free_message(capability))

    def take(self, num_bytes: int) -> list[int]:
        return self.allocator.take(blocks_for(num_bytes, self.block_bytes))

    def give_back(self, blocks: Sequence[int]) -> None:
        if blocks and not set(blocks) & set(self.lost):
            self.allocator.give_back(blocks)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for agent in list(self._peers):
            self.forget(agent)
        self.agent.deregister_memory(self._registration)


class NixlReceiver:
    """A ``KVReceiver`` of one nixl location (see the module docstring)."""

    def __init__(
        self,
        reader: NixlReader | Callable[[], NixlReader],
        location: KVLocation,
        *,
        expected_layout: KVLayout | None,
    ) -> None:
        """``reader``: the worker's, or what makes it at first use (``KVTransferError``
        where it cannot: the read falls back)."""
        self._reader = reader
        self.location = location
        self.expected_layout = expected_layout
        self.kind = location.kind
        self.state = TransferState.PENDING
        self.record = HandoffRecord(location.kind.value)
        self.compression = "none"
        self._reached = False  # the peer was resolved: a notification can reach it
        self._notified = False

    async def receive(self, timeout_s: float) -> KVPayload:
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.state = advance(self.state, TransferState.RECEIVING)
        self.record.recv_start_ns = time.monotonic_ns()
        try:
            payload = await self._receive(time.monotonic() + timeout_s)
        except BaseException:
            self.state = advance(self.state, TransferState.FAILED)
            self._notify()
            raise
        self.record.recv_end_ns = time.monotonic_ns()
        self.state = advance(self.state, TransferState.DONE)
        self._notify()
        return payload

    @property
    def reader(self) -> NixlReader:
        r = self._reader
        return r if isinstance(r, NixlReader) else r()

    def _check(self, peer: AgentDescriptor) -> list[tuple[int, int]]:
        """The handle's blocks as remote ranges: inside the pool, enough, none twice."""
        loc = self.location
        blocks = loc.blocks
        if loc.length < 1:
            raise InvalidArgumentError("kv.nixl.length", f"must be >= 1, got {loc.length}")
        need = blocks_for(loc.length, peer.block_bytes)
        if len(blocks) != need:
            raise InvalidArgumentError(
                "kv.nixl.blocks", f"{len(blocks)} blocks for {loc.length} bytes; need {need}"
            )
        if len(set(blocks)) != len(blocks):
            raise InvalidArgumentError("kv.nixl.blocks", "names a block twice")
        for b in blocks:
            peer.block_range(b)  # KVTransferError outside the registered pool
        return ranges(blocks, peer.data_addr, peer.block_bytes, loc.length)

    async def _tags_held(
        self, peer: AgentDescriptor, local: Sequence[int], deadline: float
    ) -> None:
        loc, r = self.location, self.reader
        remote = [(peer.tags_addr + b * TAG_BYTES, n * TAG_BYTES) for b, n in runs(loc.blocks)]
        tags = await r.read(loc.address, remote, local, deadline)
        tags = tags.reshape(-1, TAG_BYTES)
        # In run order, which is the handle's block order.
        cap = loc.capability
        wrong = [b for b, tag in zip(loc.blocks, tags, strict=True) if tag.tobytes() != cap]
        if wrong:
            raise KVTransferError(
                f"blocks {wrong[:8]} of {loc.address!r} are not held for hand-off "
                f"{loc.request_id!r} (released, expired, or another's)"
            )

    async def _receive(self, deadline: float) -> KVPayload:
        loc, r = self.location, self.reader
        peer = await r.peer(loc)
        self._reached = True
        remote = self._check(peer)
        tag_blocks = r.take(len(loc.blocks) * TAG_BYTES)
        data_blocks: list[int] = []
        lent = False
        try:
            await self._tags_held(peer, tag_blocks, deadline)
            data_blocks = r.take(loc.length)
            data = await r.read(loc.address, remote, data_blocks, deadline)
            await self._tags_held(peer, tag_blocks, deadline)
            # Landing blocks in one run: K and V are views over them (no copy), lent until
            # the engine imported them; else the frames are copied out of a gathered copy.
            in_place = len(runs(data_blocks)) == 1
            payload = self._parse(data, in_place=in_place)
            if in_place:
                payload, lent = r.lend(payload, data_blocks), True
        finally:
            r.give_back(tag_blocks)
            if not lent:
                r.give_back(data_blocks)
        self.record.num_bytes = loc.length
        return payload

    def _parse(self, data: np.ndarray, *, in_place: bool) -> KVPayload:
        """The payload in ``data``, every layer's CRC-32 checked; ``in_place``: K and V are
        views over ``data`` (else copies)."""
        loc = self.location
        view = data.data.cast("B").toreadonly()
        (head_len,) = LEN_PREFIX.unpack_from(view, 0)
        at = frames_offset(head_len)
        if at > len(view):
            raise KVTransferError(f"nixl payload of {loc.request_id!r}: header length {head_len}")
        header = StreamHeader.decode(bytes(view[LEN_PREFIX.size : LEN_PREFIX.size + head_len]))
        if header.request_id != loc.request_id or header.num_tokens != loc.num_tokens:
            raise KVTransferError(f"nixl payload is not {loc.request_id!r}'s, as its handle says")
        self.compression = header.compression.value
        collector = FrameCollector(header, expected_layout=self.expected_layout)
        frame, k_end = collector.frame_size, FRAME_HEAD.size + collector.part
        for layer in range(header.layout.num_layers):
            start = at + layer * frame
            if start + frame > len(view):
                raise KVTransferError(f"nixl payload of {loc.request_id!r} is cut short")
            if in_place:
                # The header-and-K and V pieces with their CRCs: the collector keeps them as
                # they lie and checks the frame's CRC, combined from these, against its header.
                for piece in (view[start : start + k_end], view[start + k_end : start + frame]):
                    collector.feed(piece, fast_crc32(piece))
            else:
                collector.feed(view[start : start + frame])  # checked and copied out
        return collector.build()

    def _notify(self) -> None:
        if self._reached and not self._notified:
            self._notified = True
            try:
                self.reader.notify_free(self.location.address, self.location.capability)
            except Exception as err:  # a dead peer: its blocks went with it
                logger.warning(
                    "NIXL: could not tell %s to free %s: %r",
                    self.location.address, self.location.request_id, err,
                )  # fmt: skip

    async def discard(self) -> None:
        """Tell the prefill worker to free the blocks if no read did (idempotent): a hand-off
        given up unread (a refused call) is freed at once, not at its lease's end."""
        if not self._reached and not self._notified:
            try:
                await self.reader.peer(self.location)
                self._reached = True
            except KVTransferError as err:
                logger.warning(
                    "NIXL: %s given up unread, its agent unreachable (%s); its lease frees it",
                    self.location.request_id, err,
                )  # fmt: skip
        self._notify()
