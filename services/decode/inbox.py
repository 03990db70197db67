"""A decode worker's own KVStore endpoint, which assembles ``direct`` hand-offs as they land.

The prefill worker streams a hand-off's layer frames into this endpoint while it computes.
Instead of keeping the chunks, the endpoint feeds them to a ``FrameCollector`` as they arrive:
each frame is checked (its CRC combined from the chunks' already checked ones) and its K and
V become tensors over the received pieces (a layer whose K and V each fit a chunk) or over a
buffer the frame was copied into once. At the last chunk the entry is committed with the
frames as its data (the same bytes: a remote ``Get`` still streams the layer stream) and the
assembled ``KVPayload`` attached, so the ``Decode`` call that follows finds the KV ready:
decoding starts as soon as the last layer has landed.

A stream that is not a hand-off (another key, or no stream header) is stored as it came. A
frame that fails its check fails the Put (once the stream is read, so that the reason reaches
the prefill worker), which then answers ``recompute``.
"""

from __future__ import annotations

from pdserve.engine.kv_payload import KVLayout
from pdserve.errors import KVTransferError, PdServeError
from pdserve.kvstore.chunks import ChunkReader
from pdserve.kvstore.keys import is_handoff_key
from pdserve.kvstore.store import KVStore, Part
from pdserve.kvstore.wire import Buffer
from pdserve.transfer.stream.frames import FrameCollector
from pdserve.transfer.stream.header import read_header
from services.kvstore.servicer import KVStoreServicer, PutSink


class _Assembler:
    """A ``PutSink`` building the payload of one hand-off.

    A frame that fails its check is reported at the end of the stream, not at once: a server
    that ends a client stream early leaves the client with a bare "internal error" instead of
    the reason.
    """

    def __init__(self, collector: FrameCollector) -> None:
        self.collector = collector
        self.error: PdServeError | None = None

    def feed(self, data: Buffer, crc32: int) -> None:
        if self.error is not None:
            return  # already refused: the rest is only read off the stream
        try:
            self.collector.feed(data, crc32)
        except PdServeError as err:  # raised by finish(), once the stream is read
            self.error = err
            self.collector.frames.clear()

    def finish(self) -> tuple[tuple[Part, ...], object | None]:
        if self.error is not None:
            raise self.error
        payload = self.collector.build()  # KVTransferError if a layer is missing
        return tuple((frame, None) for frame in self.collector.frames), payload


class InboxServicer(KVStoreServicer):
    """``KVStoreServicer`` over the decode worker's endpoint; see the module docstring."""

    def __init__(self, store: KVStore, *, expected_layout: KVLayout) -> None:
        super().__init__(store)
        self.expected_layout = expected_layout

    def sink(self, reader: ChunkReader) -> PutSink | None:
        if not is_handoff_key(reader.key):
            return None
        try:
            header = read_header(reader.header)
        except KVTransferError:
            return None  # not a layer stream: keep it as it came
        return _Assembler(FrameCollector(header, expected_layout=self.expected_layout))
