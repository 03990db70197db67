"""The KV store's key namespaces (``kvstore.keys``): each shape."""

from __future__ import annotations

from pdserve.kvstore import keys


def test_each_namespace_has_its_shape() -> None:
    cap = bytes(range(16))
    key = keys.handoff_key("req/1", cap)
    assert key == f"kv/req/1/{cap.hex()}"
    chunk = keys.prefix_chunk_key("fp", b"\xab\xcd")
    assert chunk == "pfx/fp/abcd"
    assert not key.startswith(keys.PREFIX_CHUNK_PREFIX)
