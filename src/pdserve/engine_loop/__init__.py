"""The engine thread loop: one engine on its own thread, driven from asyncio.

``AsyncEngine`` (``async_engine``) owns the thread; ``commands`` are what the event loop sends
it, ``stream_table`` is the requests' streams as the thread knows them, ``batch_window`` holds
admissions back briefly so they share a step, ``coalesce`` merges outputs that queued up while
the consumer was busy, and ``state`` is what the thread publishes (snapshots, failures, the
step model). Knows the engine; knows no worker role, gRPC or Redis.
"""
