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

A trace line's fields are read by ``pdserve.trace_file`` (``PromptPrefix``).
"""

from __future__ import annotations

import random

from pdserve.errors import InvalidArgumentError
from pdserve.trace_file import PromptPrefix
from pdserve_bench.measure import FIRST_PROMPT_ID


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
