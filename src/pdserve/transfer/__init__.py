"""KV transfer: moving one sequence's prompt KV from a prefill engine to a decode engine.

One interface (``base``: ``KVSender``/``KVReceiver``, ``KVLocation``, ``HandoffRecord``,
``TransportRegistry``, through which the hand-off's connectors, ``pdserve.handoff``, reach
the backends) and one folder per backend (``stream``, ``shm``, ``fake``).

Kept import-light on purpose: ``pdserve.transfer.links``, ``janitor`` and ``base`` must be
importable without torch (router, scheduler), so import the submodules you need directly.
See ``base.py`` for the lifecycle and ``docs/kv-transfer.md`` for the wiring.
"""
