"""Every key namespace the KV store holds, in one place: one function per key shape.

The store itself treats keys as opaque strings; the namespaces are its callers' agreement:

* hand-offs, ``kv/{request_id}/{capability hex}`` (``handoff_key``): a prefill worker's
  prompt KV for one decode worker, read once and deleted as it is read. The request id is the
  one the worker got, which the router makes unique per tenant (``RequestKey.scoped_id``,
  ``pdserve.request_key``): two tenants' equal ids never name one key. The capability (16
  random bytes, ``transfer.stamp``) makes the key unguessable: only the writer and whoever it
  answered can name the entry.
* prefix chunks, ``pfx/{kv fingerprint}/{chained hash hex}`` (``prefix_chunk_key``): cache
  entries of prompt-prefix KV shared by prefill workers (``prefix.store``), the hash that of
  the chunk's last block (``block_manager.chain_block_hashes``, salted with the tenant).
"""

from __future__ import annotations

HANDOFF_PREFIX = "kv/"
PREFIX_CHUNK_PREFIX = "pfx/"


def handoff_key(request_id: str, capability: bytes) -> str:
    """The key of a request's prompt KV: ``kv/{request_id}/{capability hex}``."""
    return f"{HANDOFF_PREFIX}{request_id}/{capability.hex()}"


def prefix_chunk_key(kv_fingerprint: str, chunk_hash: bytes) -> str:
    """The key of a prompt-prefix chunk: ``pfx/{kv fingerprint}/{hash of its last block}``."""
    return f"{PREFIX_CHUNK_PREFIX}{kv_fingerprint}/{chunk_hash.hex()}"
