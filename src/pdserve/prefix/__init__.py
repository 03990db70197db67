"""Prefix reuse: KV of shared prompt prefixes, found where it already lies.

``store``: ``PrefixReuse``, prefix chunks shared through the KV store by prefill workers.
``decode``: the decode worker's own prefix cache, asked before a hand-off so only the blocks
it lacks are sent.
"""
