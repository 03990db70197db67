"""Prefix reuse from the chosen decode worker: send only the KV blocks it lacks.

A decode worker's engine keeps the blocks of prompts it decoded in its prefix cache. Before a
hand-off the prefill worker asks it (``ask``) how many leading blocks of the prompt it holds,
with a ``Decode.CachedPrefix`` call (``handoff.peers.DecodePeers``) carrying a
``PrefixQuery``: the engine's KV fingerprint, its block size and one hash per whole block,

    block_manager.chain_block_hashes(prompt, block_size, salt=tenant)

which covers every token before it and the tenant, so a tenant never learns about (or gets)
another tenant's blocks. The decode worker answers from its engine's cache map, on the engine
thread (``DecodePrefixOracle``); another model, dtype or block size answers 0.

The prefill worker then computes as before, but its hand-off skips the first
``prefix_tokens`` tokens of every layer (``HandoffPlan.prefix_tokens``, ``handoff.outgoing``);
the ``KVHandle`` carries ``prefix_tokens``. The decode worker, after receiving the rest,
copies the prefix out of its cache and joins the two (``join_cached_prefix``). The answer is
only a hint: if the blocks were evicted in between, the join raises ``UnknownRequestError``
and the decode worker recomputes, as after any failed receive. Nothing is pinned, so nothing
can leak.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.backends import EngineBackend
from pdserve.engine.block_manager import chain_block_hashes
from pdserve.engine.kv_arrays import concat
from pdserve.engine.kv_payload import KVLayout, KVPayload, kv_fingerprint
from pdserve.errors import PdServeError, UnknownRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefixQuery:
    """Which leading blocks of a prompt a decode worker holds (``Decode.CachedPrefix``)."""

    kv_fingerprint: str
    """``kv_payload.kv_fingerprint`` of the asking engine's layout."""
    block_size: int
    block_hashes: tuple[bytes, ...]
    """Chained, tenant-salted hashes of the prompt's whole blocks, first block first."""


def prompt_block_hashes(prompt_ids: Sequence[int], block_size: int, tenant: str) -> list[bytes]:
    """Chained hashes of the prompt's whole blocks; the last token is never in one (the
    receiving side needs at least one token of payload)."""
    n_full = (len(prompt_ids) - 1) // block_size
    if n_full <= 0:
        return []
    return chain_block_hashes(list(prompt_ids[: n_full * block_size]), block_size, salt=tenant)


def prefix_query(layout: KVLayout, prompt_ids: Sequence[int], tenant: str) -> PrefixQuery:
    """The query of the prompt's whole blocks (see the module docstring)."""
    return PrefixQuery(
        kv_fingerprint(layout),
        layout.block_size,
        tuple(prompt_block_hashes(prompt_ids, layout.block_size, tenant)),
    )


class CachedPrefixClients(Protocol):
    """Asks decode workers by address (``handoff.peers.DecodePeers``); failures are
    ``PdServeError``s."""

    async def cached_prefix(self, address: str, query: PrefixQuery) -> int:
        """Leading blocks of ``query`` the decode worker at ``address`` holds."""
        ...


async def ask(
    clients: CachedPrefixClients,
    address: str,
    layout: KVLayout,
    prompt_ids: Sequence[int],
    tenant: str,
) -> int:
    """Leading prompt tokens the decode worker at ``address`` holds (whole blocks); 0 when it
    holds none or cannot say (the hand-off then moves the whole prompt, as before)."""
    query = prefix_query(layout, prompt_ids, tenant)
    if not query.block_hashes:
        return 0
    try:
        found = await clients.cached_prefix(address, query)
    except PdServeError as err:
        logger.warning("decode prefix query at %s failed: %s", address, err)
        return 0
    return min(found, len(query.block_hashes)) * layout.block_size


class DecodePrefixOracle:
    """Answers ``PrefixQuery``s from a decode worker's engine (``Decode.CachedPrefix``)."""

    def __init__(self, engine: EngineBackend) -> None:
        self.engine = engine
        self.kv_fingerprint = kv_fingerprint(engine.layout)
        self.block_size = engine.layout.block_size

    async def __call__(self, query: PrefixQuery) -> int:
        if (query.kv_fingerprint, query.block_size) != (self.kv_fingerprint, self.block_size):
            return 0  # another model, dtype or block size: nothing of ours
        if not query.block_hashes:
            return 0
        # A hint: the blocks may be evicted before the hand-off lands (join_cached_prefix).
        return await self.engine.cached_prefix_blocks(list(query.block_hashes))


async def join_cached_prefix(
    engine: EngineBackend,
    payload: KVPayload,
    prompt_ids: Sequence[int],
    prefix_tokens: int,
    tenant: str,
) -> KVPayload:
    """The whole prompt's KV: this engine's cached ``prompt_ids[:prefix_tokens]`` followed by
    ``payload`` (the rest). ``UnknownRequestError`` if the prefix is no longer cached (the
    caller recomputes)."""
    layout = engine.layout
    bs = layout.block_size
    if prefix_tokens % bs or prefix_tokens + payload.num_tokens != len(prompt_ids):
        raise UnknownRequestError(
            f"a prefix of {prefix_tokens} tokens plus {payload.num_tokens} received does not "
            f"make a prompt of {len(prompt_ids)} in blocks of {bs}"
        )
    hashes = chain_block_hashes(list(prompt_ids[:prefix_tokens]), bs, salt=tenant)
    prefix = await engine.export_cached_prefix(hashes)
    if prefix is None:
        raise UnknownRequestError(f"the cached prefix of {prefix_tokens} tokens was evicted")
    layout.check_compatible(payload.layout)
    n = layout.num_layers
    joined = KVPayload(
        payload.layout,
        len(prompt_ids),
        tuple(concat([prefix.keys[i], payload.keys[i]]) for i in range(n)),
        tuple(concat([prefix.values[i], payload.values[i]]) for i in range(n)),
    )
    if payload.release is not None:  # copied out: the transport's memory is free again
        payload.release()
    return joined
