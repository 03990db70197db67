"""KV transfer: moving one sequence's prompt KV from a prefill engine to a decode engine.

Kept import-light on purpose: ``pdserve.transfer.policy`` and ``pdserve.transfer.janitor`` must
be importable without torch (router, scheduler), so import the submodules you need directly.
See ``base.py`` for the lifecycle and ``docs/kv-transfer.md`` for the wiring.
"""
