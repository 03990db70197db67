"""A prefill side in its own process (the tests' peer that vanishes): it registers a pool,
commits one hand-off per ``"hand-off"`` on ``conn`` and sends back its location; on
``"begun"`` it begins one, writes its first layer only and sends back the location being
written (a reader follows it); until told to stop (or killed)."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection

from pdserve.transfer.nixl.pool import NixlPool
from pdserve.transfer.nixl.sender import NixlSender
from tests.unit.transfer.conftest import make_layout, random_payload


def serve(conn: Connection, num_tokens: int, pool_bytes: int = 64 << 20) -> None:
    pool = NixlPool(num_bytes=pool_bytes, block_bytes=64 << 10)
    conn.send((pool.name, pool.published, pool.fingerprint))
    payload = random_payload(make_layout(num_layers=4), num_tokens)
    n = 0
    writing = []  # begun hand-offs, kept open
    while (asked := conn.recv()) in ("hand-off", "begun"):
        sender = NixlSender(pool)
        n += 1
        sender.begin(f"r{n}", payload.layout, num_tokens)
        if asked == "begun":
            sender.send_layer(0, payload.keys[0], payload.values[0])
            writing.append(sender)
            conn.send(sender.planned())
            continue
        for i in range(payload.layout.num_layers):
            sender.send_layer(i, payload.keys[i], payload.values[i])
        conn.send(asyncio.run(sender.commit(5.0)))
    pool.close()
