"""The ``nixl`` transport: one-sided NIXL READs of a prefill worker's registered KV blocks.

``agent.py`` (loading NIXL, ``AgentDescriptor``: what a heartbeat publishes), ``blocks.py``
(block allocation, runs, descriptor pairs and pieces), ``pool.py`` (``NixlPool``, the prefill
side's registered blocks), ``sender.py`` (``NixlSender``), ``reader.py`` (``NixlReader``,
``AgentDirectory``), ``receiver.py`` (``NixlReceiver``). NIXL itself is the optional extra
``pdserve[nixl]``; ``agent.py`` and ``blocks.py`` import without it. See docs/kv-transfer.md.
"""
