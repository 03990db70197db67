"""Fixtures of the benchmark tests: a local OpenAI-style streaming server."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from .fakes import FakeOpenAI, Handler


@pytest.fixture
def openai_server() -> Iterator[FakeOpenAI]:
    srv = FakeOpenAI(("127.0.0.1", 0), Handler)
    srv.bodies = []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join()
