"""The KV hand-off between a prefill and a decode worker: one owner per side.

* ``PrefillConnector`` (``prefill.py``) plans each hand-off once (``HandoffPlan``, ``plan.py``:
  which transport, layer-wise or not, compressed or not, which prompt prefix the decode
  worker already holds, announced or not, recompute instead of moving) and carries it out
  (``Outgoing``, ``outgoing.py``: the layer hook, the commit, the fall back to recompute, the
  clean-up), on the resources it owns (threads, reused shm segments, connections to decode
  workers, ``peers.py``; the reservation check, ``assignment.py``).
* ``DecodeConnector`` (``decode.py``) takes each hand-off in (``Incoming``: the bounded
  receive, a prefetch's read taken over, the cached prefix joined, the recompute when the
  KV does not come, the transport's copy freed), and owns the receiving side's resources
  (the ``direct`` inbox, KV store connections, reads begun early, ``prefetch.py``).

The workers call their connector and know nothing of transports; the transports themselves
(``store``, ``direct``, ``shm``, and the in-memory fake of tests) are ``pdserve.transfer``'s,
behind its ``KVSender``/``KVReceiver`` interface, registered in a ``TransportRegistry``
that a connector is built with.
"""

from __future__ import annotations

from pdserve.handoff.decode import Arrival, DecodeConnector, Incoming
from pdserve.handoff.outgoing import Outgoing, Sent
from pdserve.handoff.plan import HandoffPlan, HandoffRoute, TransferOptions
from pdserve.handoff.prefill import PrefillConnector

__all__ = [
    "Arrival",
    "DecodeConnector",
    "HandoffPlan",
    "HandoffRoute",
    "Incoming",
    "Outgoing",
    "PrefillConnector",
    "Sent",
    "TransferOptions",
]
