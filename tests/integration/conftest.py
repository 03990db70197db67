"""Fixtures for integration tests: one real redis-server for the whole session.

Tests isolate themselves with their own key namespace (``KeySpace``) instead of flushing the
database, so that they can share the server.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A redis-server process on a free loopback port, stopped at the end of the session."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    """``redis://127.0.0.1:<port>/0`` of the session's Redis."""
    return redis_server.url
