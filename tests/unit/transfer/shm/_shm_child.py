"""Run in a spawned child by the janitor tests: hand off a segment, then wait to be killed."""

from __future__ import annotations

from multiprocessing.connection import Connection

from pdserve.transfer.shm.writer import SegmentWriter
from tests.unit.transfer.conftest import make_layout, random_payload


def hand_off_and_hang(prefix: str, conn: Connection) -> None:
    """Seal a segment as a prefill worker would, report its name, block until killed."""
    payload = random_payload(make_layout(num_layers=2), 8)
    sender = SegmentWriter(prefix=prefix)
    sender.begin("orphan", payload.layout, 8)
    for i in range(2):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    conn.send(sender.finish().key)
    conn.recv()  # never answered: the parent SIGKILLs this process
