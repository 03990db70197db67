"""``fake``: an in-memory transport for tests, on the real frames of ``transfer.stream``
(``transport.py``)."""

from pdserve.transfer.fake.transport import FAKE_ADDRESS, FakeHub, FakeReceiver, FakeSender

__all__ = ["FAKE_ADDRESS", "FakeHub", "FakeReceiver", "FakeSender"]
