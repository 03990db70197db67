"""The KV store's key namespaces (``kvstore.keys``): each shape, and the names the hand-off
code still takes from ``worker.handoff``."""

from __future__ import annotations

from pdserve.kvstore import keys
from pdserve.worker import handoff


def test_each_namespace_has_its_shape() -> None:
    cap = bytes(range(16))
    key = keys.handoff_key("req/1", cap)
    assert key == f"kv/req/1/{cap.hex()}"
    assert keys.is_handoff_key(key)
    chunk = keys.prefix_chunk_key("fp", b"\xab\xcd")
    assert chunk == "pfx/fp/abcd"
    assert not keys.is_handoff_key(chunk)
    assert not key.startswith(keys.PREFIX_CHUNK_PREFIX)


def test_the_hand_off_names_are_the_namespace_s() -> None:
    assert handoff.STORE_KEY_PREFIX == keys.HANDOFF_PREFIX
    assert handoff.store_key("r", b"\x01") == keys.handoff_key("r", b"\x01") == "kv/r/01"
