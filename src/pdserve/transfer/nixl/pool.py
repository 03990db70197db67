"""``NixlPool``: a prefill worker's KV block pool, registered with its NIXL agent once.

One region of host memory is registered when the worker starts and stays registered until it
stops (registration is the expensive part of NIXL; nothing is registered per request)::

    tags: num_blocks x 16 bytes (pad to 4 KiB) | blocks: num_blocks x block_bytes

A hand-off takes blocks (``take``), its header is written and each of its blocks' tag is set
to the hand-off's capability (``open``), its layers are written into them as the engine makes
them (``write``, the layer hook's thread; each layer's ready mark after its frame), and the
commit starts its lease (``seal``). The decode worker reads the tags, then the blocks (all at
once after the commit, or layer by layer as the marks appear when it follows the writer),
then the tags again, with one-sided READs, and accepts the data only if every tag was the
handle's capability both times: blocks that are not (or no longer) held for that hand-off are
never taken for its KV. It then sends the agent a notification naming the capability, and
``poll`` frees that hand-off's blocks (tags cleared first); one that comes before the commit
(a reader that followed the writer to its last layer) frees them at the commit, never under
the writer. A hand-off whose reader never comes is freed after its lease (``expire``); a
discarded or revoked one at once (``release``).

``descriptor`` (``AgentDescriptor``: the agent's metadata, the region's addresses and block
size) is what the worker's heartbeat publishes, with its fingerprint.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.nixl.agent import TAG_BYTES, AgentDescriptor, make_agent, nixl_api
from pdserve.transfer.nixl.blocks import BlockAllocator, blocks_for

logger = logging.getLogger(__name__)

FREE_PREFIX = b"pdserve-free:"
"""A reader's notification: this prefix, then the hand-off's capability in hex."""
PAGE = 4096


def free_message(capability: bytes) -> bytes:
    return FREE_PREFIX + capability.hex().encode()


@dataclass(slots=True)
class Held:
    """A hand-off's blocks, from ``open`` until its reader's notification or its lease's end
    (after the seal), or its discard."""

    request_id: str
    blocks: tuple[int, ...]
    expires_at: float
    """``time.monotonic``; infinite until the seal (the writer discards what it never seals)."""
    sealed: bool = False
    read: bool = False
    """Its reader's notification came before the seal: the seal frees it."""


class NixlPool:
    """See the module docstring. ``num_bytes`` of blocks of ``block_bytes``; ``lease_s``: how
    long a sealed hand-off waits for its reader."""

    def __init__(
        self,
        *,
        num_bytes: int,
        block_bytes: int,
        lease_s: float = 60.0,
        host: str | None = None,
        name: str | None = None,
    ) -> None:
        if block_bytes < PAGE or block_bytes % PAGE:
            raise InvalidArgumentError(
                "nixl_block_bytes", f"must be a multiple of {PAGE}, got {block_bytes}"
            )
        if num_bytes < block_bytes:
            raise InvalidArgumentError(
                "nixl_pool_bytes", f"must hold at least one block, got {num_bytes}"
            )
        if not lease_s > 0:
            raise InvalidArgumentError("lease_s", f"must be > 0, got {lease_s}")
        api = nixl_api()
        self.host = host or socket.gethostname()
        self.lease_s = lease_s
        self.name = name or f"pdserve-prefill-{self.host}-{secrets.token_hex(6)}"
        self.agent = make_agent(api, self.name)
        n = num_bytes // block_bytes
        tags_len = -(-n * TAG_BYTES // PAGE) * PAGE
        self._mem = np.zeros(tags_len + n * block_bytes, dtype=np.uint8)
        base = self._mem.ctypes.data
        self._registration = self.agent.register_memory([(base, self._mem.nbytes, 0, "")], "DRAM")
        view = self._mem
        self.tags = view[: n * TAG_BYTES].reshape(n, TAG_BYTES)
        self.data = view[tags_len:]
        self.descriptor = AgentDescriptor(
            agent=self.name,
            metadata=self.agent.get_agent_metadata(),
            tags_addr=base,
            data_addr=base + tags_len,
            num_blocks=n,
            block_bytes=block_bytes,
        )
        self.published = self.descriptor.encode()
        """The descriptor as the heartbeat carries it (``WorkerInfo.kv_agent``)."""
        self.fingerprint = self.descriptor.fingerprint
        self.block_bytes = block_bytes
        self.allocator = BlockAllocator(n)
        self._held: dict[bytes, Held] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- blocks ---------------------------------------------------------------------------
    def take(self, num_bytes: int) -> list[int]:
        """Blocks for a payload of ``num_bytes`` (``CapacityError`` when the pool is short,
        after freeing what readers are done with)."""
        count = blocks_for(num_bytes, self.block_bytes)
        if count > self.allocator.num_free:
            self.poll()
        return self.allocator.take(count)

    def write(self, blocks: Sequence[int], offset: int, src: np.ndarray) -> None:
        """Copy ``src`` (uint8) to bytes ``offset..`` of the payload laid over ``blocks``."""
        bb = self.block_bytes
        done = 0
        while done < len(src):
            pos = offset + done
            i, within = divmod(pos, bb)
            # Extend over consecutive blocks: one copy per contiguous run.
            end = i + 1
            while end < len(blocks) and blocks[end] == blocks[end - 1] + 1:
                end += 1
            start = blocks[i] * bb + within
            take = min(len(src) - done, (end - i) * bb - within)
            self.data[start : start + take] = src[done : done + take]
            done += take

    def open(self, capability: bytes, request_id: str, blocks: Sequence[int]) -> None:
        """The hand-off's blocks become its own: their tags its capability (a reader that
        follows the writer checks them before it reads a layer)."""
        tag = np.frombuffer(capability, dtype=np.uint8)
        with self._lock:
            self.tags[list(blocks)] = tag
            self._held[capability] = Held(request_id, tuple(blocks), float("inf"))

    def seal(self, capability: bytes, request_id: str, blocks: Sequence[int]) -> None:
        """The hand-off is committed: its lease starts (``open`` first, unless this opens it
        too); one its reader is done with already is freed."""
        if capability not in self._held:
            self.open(capability, request_id, blocks)
        with self._lock:
            held = self._held[capability]
            held.sealed, held.expires_at = True, time.monotonic() + self.lease_s
            read = held.read
        if read:
            self.release(capability)

    def free(self, blocks: Sequence[int]) -> None:
        """Blocks taken but never opened."""
        self.allocator.give_back(blocks)

    def release(self, capability: bytes) -> bool:
        """Free a hand-off's blocks (tags first), sealed or not (its writer discards it);
        False if it is not held."""
        with self._lock:
            held = self._held.pop(capability, None)
            if held is None:
                return False
            self.tags[list(held.blocks)] = 0
        self.allocator.give_back(held.blocks)
        return True

    @property
    def held(self) -> int:
        """Hand-offs holding blocks: being written, or sealed and waiting for their reader."""
        return len(self._held)

    def _read(self, capability: bytes) -> bool:
        """A reader is done with the hand-off: free it, or once sealed if it is not yet (its
        writer may still be in its blocks); whether it was freed."""
        with self._lock:
            held = self._held.get(capability)
            if held is not None and not held.sealed:
                held.read = True
                return False
        return self.release(capability)

    # -- notifications and leases ---------------------------------------------------------
    def poll(self) -> int:
        """Free the hand-offs whose readers said they are done; how many were freed."""
        if self._closed:
            return 0
        freed = 0
        for agent, messages in self.agent.get_new_notifs().items():
            for message in messages:
                if not message.startswith(FREE_PREFIX):
                    logger.warning("NIXL agent %s sent an unknown notification", agent)
                    continue
                try:
                    capability = bytes.fromhex(message[len(FREE_PREFIX) :].decode())
                except ValueError:
                    logger.warning("NIXL agent %s sent a malformed free notification", agent)
                    continue
                freed += self._read(capability)
        return freed

    def expire(self, now: float | None = None) -> int:
        """Free the sealed hand-offs whose lease ran out unread; how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [
                (c, h.request_id) for c, h in self._held.items() if h.sealed and h.expires_at <= now
            ]
        for cap, request_id in late:
            if self.release(cap):
                logger.warning("NIXL hand-off %s expired unread; its blocks are freed", request_id)
        return len(late)

    def settle(self, timeout_s: float) -> int:
        """Poll until no hand-off is held or ``timeout_s`` passed; how many still are (a
        shutdown that lets the last readers finish; tests)."""
        deadline = time.monotonic() + timeout_s
        while self.poll() >= 0 and self._held and time.monotonic() < deadline:
            time.sleep(0.001)  # notifications arrive on NIXL's progress thread
        return len(self._held)

    def sweep(self) -> None:
        self.poll()
        self.expire()

    def close(self) -> None:
        """Deregister the pool (once); every hand-off still held is dropped with it."""
        if self._closed:
            return
        self._closed = True
        self.agent.deregister_memory(self._registration)
