"""KVStore service: holds KV payloads in flight between prefill and decode workers."""
