"""Prompts for a replayed trace that keep the captured traffic's prefix sharing.

A captured trace (``pdserve trace capture``) holds no token ids, only each prompt's chained
block hashes (``block_hashes``, ``block_size`` tokens a block, over the full blocks of the
prompt but its last token). Because the hashes are chained, two prompts with equal hash ``i``
had equal tokens up to the end of block ``i``. So mapping every distinct hash to one token
block of its own, and building a prompt as the blocks of its hashes followed by tokens unique
to the request, gives prompts that share exactly the leading blocks the captured ones
shared: prefix caching and KV-aware placement find in the replay what they found live.

A hash's block is drawn from a ``random.Random`` seeded by the hash, the block size and a key
(the benchmark's seed and the point's rate), so it is the same in every process and on every
target, and differs between points as every other prompt token does.

This module also reads the optional fields of a trace line (``block_hashes``,
``block_size``, ``tenant``), refusing malformed ones by name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pdserve.bench.measure import FIRST_PROMPT_ID
from pdserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """What a trace line says of its prompt's content: its leading blocks, by hash."""

    block_hashes: tuple[bytes, ...] = ()
    """The chained hashes of the prompt's leading full blocks; empty: nothing known."""
    block_size: int | None = None
    """Tokens a block (set whenever ``block_hashes`` is not empty)."""
    tenant: str | None = None
    """The captured request's tenant (``""``: none); the hashes are salted with it, so two
    tenants' prompts never share a replayed block, as they never shared cached KV."""

    @property
    def shared_tokens(self) -> int:
        """Leading prompt tokens the hashes fix."""
        return len(self.block_hashes) * (self.block_size or 0)


NO_PREFIX = PromptPrefix()
"""A trace line that says nothing of its prompt's content."""


def read_prefix(obj: dict[str, Any], prompt_tokens: int, where: str) -> PromptPrefix:
    """The optional prefix fields of one trace line (``obj``, already checked to have a
    valid ``prompt_tokens``); ``InvalidArgumentError`` names the malformed field."""
    tenant = obj.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidArgumentError("trace", f"{where}: tenant must be a string")
    size = obj.get("block_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise InvalidArgumentError("trace", f"{where}: block_size must be an integer >= 1")
    raw = obj.get("block_hashes")
    if raw is None:
        return PromptPrefix(tenant=tenant, block_size=size)
    if not isinstance(raw, list):
        raise InvalidArgumentError("trace", f"{where}: block_hashes must be a list of hex strings")
    hashes = tuple(_hash(value, i, where) for i, value in enumerate(raw))
    if hashes and size is None:
        raise InvalidArgumentError("trace", f"{where}: block_size is needed with block_hashes")
    if size is not None and len(hashes) > max(0, prompt_tokens - 1) // size:
        raise InvalidArgumentError(
            "trace",
            f"{where}: block_hashes has {len(hashes)} blocks of {size} tokens, more than a "
            f"prompt of {prompt_tokens} tokens holds before its last token",
        )
    return PromptPrefix(hashes, size, tenant)


def _hash(value: object, i: int, where: str) -> bytes:
    if isinstance(value, str) and value and len(value) % 2 == 0:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    raise InvalidArgumentError(
        "trace", f"{where}: block_hashes[{i}] must be a non-empty hex string, got {value!r}"
    )


class BlockTokens:
    """The token block of every captured block hash of one point, made once each.

    ``key`` seeds every block (with the hash and the block size): the same key gives the same
    blocks in any process."""

    def __init__(self, vocab_size: int, key: str) -> None:
        if vocab_size <= FIRST_PROMPT_ID:
            raise InvalidArgumentError(
                "vocab_size", f"must exceed {FIRST_PROMPT_ID}, got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.key = key
        self._blocks: dict[tuple[bytes, int], tuple[int, ...]] = {}

    def block(self, block_hash: bytes, block_size: int) -> tuple[int, ...]:
        """``block_size`` token ids in ``[FIRST_PROMPT_ID, vocab_size)`` for ``block_hash``."""
        found = self._blocks.get((block_hash, block_size))
        if found is None:
            rng = random.Random(f"{self.key}:block:{block_size}:{block_hash.hex()}")
            found = tuple(
                rng.randrange(FIRST_PROMPT_ID, self.vocab_size) for _ in range(block_size)
            )
            self._blocks[(block_hash, block_size)] = found
        return found

    def prompt(self, prefix: PromptPrefix, prompt_tokens: int, rng: random.Random) -> list[int]:
        """A prompt of ``prompt_tokens`` ids: the blocks of ``prefix``'s hashes, then ids drawn
        from ``rng`` (the request's own: no other prompt has them)."""
        out: list[int] = []
        if prefix.block_size is not None:
            for h in prefix.block_hashes:
                out += self.block(h, prefix.block_size)
        if len(out) > prompt_tokens:  # read_prefix refuses it; a hand-made PromptPrefix may not
            raise InvalidArgumentError("block_hashes", "more blocks than the prompt holds")
        tail = prompt_tokens - len(out)
        out += (rng.randrange(FIRST_PROMPT_ID, self.vocab_size) for _ in range(tail))
        return out
