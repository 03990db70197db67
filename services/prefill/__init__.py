"""Prefill service: computes prompts' KV caches and first tokens, hands the KV to a KV store."""
