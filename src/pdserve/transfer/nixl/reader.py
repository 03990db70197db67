"""The decode side of nixl hand-offs: ``NixlReader``, one per decode worker (its NIXL agent,
its landing blocks registered once, the prefill agents it has loaded, the READs), and
``AgentDirectory``, where prefill workers publish their agents. ``receiver.py`` reads one
hand-off with it (``NixlReceiver``).

A peer's descriptor is looked up by the handle's agent name; its fingerprint must equal both
the one published beside it and the one the handle names, or nothing is loaded. The agent's
metadata is loaded once per fingerprint (a restarted worker publishes another).

Every transfer is polled on the event loop until it is done, failed, or the deadline passed;
one that cannot be released leaves its landing blocks out of use for good, so no late write
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

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import InvalidArgumentError, KVPayloadMismatchError, KVTransferError
from pdserve.transfer.base import KVLocation
from pdserve.transfer.nixl.agent import AgentDescriptor, fingerprint, make_agent, nixl_api
from pdserve.transfer.nixl.blocks import (
    BlockAllocator,
    Pair,
    blocks_for,
    cut_pieces,
    pair_ranges,
    ranges,
    runs,
)
from pdserve.transfer.nixl.pool import PAGE, free_message

logger = logging.getLogger(__name__)

POLL_S = (0.00005, 0.002)
"""First and longest pause between polls of a transfer's state (after ``SPINS`` polls that
only yield to the event loop: a small READ is done in tens of microseconds)."""
SPINS = 8


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
        self.agent = make_agent(api, self.name)
        n = max(1, num_bytes // block_bytes)
        self._mem = np.zeros(n * block_bytes, dtype=np.uint8)
        self.base = self._mem.ctypes.data
        self._registration = self.agent.register_memory(
            [(self.base, self._mem.nbytes, 0, "")], "DRAM"
        )
        self.data = self._mem
        self.block_bytes = block_bytes
        self.allocator = BlockAllocator(n)
        self.lost: list[int] = []
        """Landing blocks of transfers that could not be released: never reused."""
        self.lent = 0
        """Landing blocks that received payloads lie in, until the engine imported them."""
        self._lock = threading.Lock()
        # Agent name -> the fingerprint and descriptor of the metadata loaded for it.
        self._peers: dict[str, tuple[str, AgentDescriptor]] = {}
        self._closed = False

    async def peer(self, location: KVLocation) -> AgentDescriptor:
        """The descriptor of the location's agent, loaded: looked up and checked once per
        fingerprint (later hand-offs naming the same one need no look-up)."""
        agent, expected = location.address, location.key
        cached = self._peers.get(agent)
        if cached is not None and cached[0] == expected:
            return cached[1]
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
        self.forget(agent)  # another fingerprint was loaded for it: a restarted worker
        loaded = self.agent.add_remote_agent(descriptor.metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != agent:
            self.agent.remove_remote_agent(name)
            raise KVTransferError(f"metadata published for {agent!r} is agent {name!r}")
        self._peers[agent] = (actual, descriptor)
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
        *,
        on_piece: Callable[[int], None] | None = None,
        piece_bytes: int = 0,
        notif: bytes = b"",
    ) -> np.ndarray:
        """READ ``remote`` ranges into ``local_blocks`` (in order) before ``deadline``
        (monotonic); the landed bytes, contiguous (a view when the blocks are one run, else
        a copy). ``piece_bytes``: READ in pieces of that size, all posted at once, and call
        ``on_piece(end offset)`` as each one lands, in order (0: one READ). ``notif``: a
        notification the peer gets once the (last) READ is done."""
        total = sum(n for _, n in remote)
        local = ranges(local_blocks, self.base, self.block_bytes, total)
        await self.read_pairs(
            agent, pair_ranges(local, remote), local_blocks, deadline,
            on_piece=on_piece, piece_bytes=piece_bytes, notif=notif,
        )  # fmt: skip
        return self.landing(local_blocks, total)

    async def read_pairs(
        self,
        agent: str,
        pairs: Sequence[Pair],
        local_blocks: Sequence[int],
        deadline: float,
        *,
        on_piece: Callable[[int], None] | None = None,
        piece_bytes: int = 0,
        notif: bytes = b"",
    ) -> None:
        """``read`` of ``(local, remote)`` range pairs (``blocks.pair_ranges``) whose local
        ranges lie in ``local_blocks`` (never handed out again if the READ cannot be
        released)."""
        pieces = cut_pieces(pairs, piece_bytes)
        await self._transfer(agent, pieces, local_blocks, deadline, on_piece, notif)

    def landing(self, blocks: Sequence[int], length: int) -> np.ndarray:
        """The first ``length`` bytes laid over landing ``blocks``: a view if they are one
        run, else a gathered copy."""
        if len(runs(blocks)) == 1:
            start = blocks[0] * self.block_bytes
            return self.data[start : start + length]
        local = ranges(blocks, self.base, self.block_bytes, length)
        return np.concatenate([self.data[a - self.base : a - self.base + n] for a, n in local])

    async def _transfer(
        self,
        agent: str,
        pieces: Sequence[tuple[list[Pair], int]],
        local: Sequence[int],
        deadline: float,
        on_piece: Callable[[int], None] | None,
        notif: bytes,
    ) -> None:
        handles: list[Any] = []
        done = 0
        try:
            try:
                states = []
                for i, (pairs, _) in enumerate(pieces):
                    ld = np.array([(a, n, 0) for (a, n), _ in pairs], dtype=np.uint64)
                    rd = np.array([(a, n, 0) for _, (a, n) in pairs], dtype=np.uint64)
                    handles.append(
                        self.agent.initialize_xfer(
                            "READ",
                            self.agent.get_xfer_descs(ld, "DRAM"),
                            self.agent.get_xfer_descs(rd, "DRAM"),
                            agent,
                            notif if i == len(pieces) - 1 else b"",
                        )
                    )
                    states.append(self.agent.transfer(handles[-1]))
                for (_, end), handle, state in zip(pieces, handles, states, strict=True):
                    pause, polls = POLL_S[0], 0
                    while state == "PROC":
                        if time.monotonic() >= deadline:
                            raise KVTransferError(f"NIXL read from {agent!r} passed its deadline")
                        # Polls the transfer (NIXL has no awaitable): at first only yielding.
                        await asyncio.sleep(0 if polls < SPINS else pause)
                        if polls >= SPINS:
                            pause = min(pause * 2, POLL_S[1])
                        polls += 1
                        state = self.agent.check_xfer_state(handle)
                    if state != "DONE":
                        self.forget(agent)
                        raise KVTransferError(f"NIXL read from {agent!r} ended in {state}")
                    done += 1
                    if on_piece is not None:
                        on_piece(end)  # checks what landed while the rest is on the wire
            except (KVTransferError, KVPayloadMismatchError):
                raise
            except Exception as err:  # NIXL's own errors (not found, disconnected, ...)
                self.forget(agent)
                raise KVTransferError(f"NIXL read from {agent!r} failed: {err!r}") from err
        finally:
            unreleased = 0
            for handle in handles:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception as err:
                    unreleased += 1
                    logger.error("NIXL: releasing a read from %s failed: %r", agent, err)
            if unreleased and done < len(handles):
                self.lost.extend(local)  # may still be written: never handed out again

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
