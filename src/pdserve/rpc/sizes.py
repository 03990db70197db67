"""The size bound of a gRPC message between pdserve processes, and from a client."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The largest gRPC message a pdserve process (or the SDK) sends or receives: KV payloads
travel as streams of chunks, but a chunk may still be several MiB. The router receives less
(``RequestLimits.receive_bytes``)."""
