"""``fake``: an in-memory transport for tests, on the real frames of ``transfer.stream``
(``transport.py``), registered in a connector as the real ones are (``fake_transports``)."""

from pdserve.transfer.fake.transport import (
    FAKE_ADDRESS,
    FakeHub,
    FakeReceiver,
    FakeSender,
    fake_transports,
)

__all__ = ["FAKE_ADDRESS", "FakeHub", "FakeReceiver", "FakeSender", "fake_transports"]
