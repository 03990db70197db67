"""``PayloadParser``: a nixl payload's header and frames checked as its bytes land.

The payload's layout is ``blocks.py``'s. The header must name the handle's request and token
count; each layer's frame is checked by ``FrameCollector`` (CRC-32, the layout against this
engine's) in layer order, as soon as the bytes up to its end are in (``arrived``). A read
after the commit also checks each layer's ready mark (``marks``): a layer its writer never
wrote is refused by name. A read that follows the writer reads only marked layers, so it has
checked the marks already (from its polls).
"""

from __future__ import annotations

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import KVTransferError
from pdserve.kvstore.crc import fast_crc32
from pdserve.transfer.base import KVLocation
from pdserve.transfer.nixl.blocks import (
    LEN_PREFIX,
    MARK_BYTES,
    frames_offset,
    layer_mark,
    marks_offset,
)
from pdserve.transfer.stream.frames import FRAME_HEAD, FrameCollector
from pdserve.transfer.stream.header import StreamHeader

Bytes = bytes | bytearray | memoryview


class PayloadParser:
    """One payload's checks (see the module docstring); ``in_place``: K and V are views over
    ``view`` (else copies); ``marks``: check each layer's ready mark in ``view``."""

    def __init__(
        self, loc: KVLocation, expected: KVLayout | None, *, in_place: bool, marks: bool = True
    ) -> None:
        self.loc, self.expected, self.in_place, self.marks = loc, expected, in_place, marks
        self.view = memoryview(b"")
        """The payload's bytes as they land (offsets as in the payload)."""
        self.collector: FrameCollector | None = None
        self.marks_at = self.at = self.frame = self.k_end = 0
        self.next = 0
        """Layers checked so far (in layer order)."""
        self.compression = "none"

    @property
    def num_layers(self) -> int:
        if self.collector is None:
            raise KVTransferError(f"nixl payload of {self.loc.request_id!r}: header not read")
        return self.collector.header.layout.num_layers

    def header(self, lead: Bytes, landed: int) -> int:
        """Parse the header from ``lead`` (the payload's first ``landed`` bytes, at least);
        0 once parsed, else how many leading bytes it needs."""
        loc = self.loc
        if landed < LEN_PREFIX.size:
            return LEN_PREFIX.size
        (head_len,) = LEN_PREFIX.unpack_from(lead, 0)
        end = LEN_PREFIX.size + head_len
        if end > loc.length:
            raise KVTransferError(f"nixl payload of {loc.request_id!r}: header length {head_len}")
        if landed < end:
            return end
        header = StreamHeader.decode(bytes(lead[LEN_PREFIX.size : end]))
        if header.request_id != loc.request_id or header.num_tokens != loc.num_tokens:
            raise KVTransferError(f"nixl payload is not {loc.request_id!r}'s, as its handle says")
        self.compression = header.compression.value
        c = FrameCollector(header, expected_layout=self.expected)
        layers = header.layout.num_layers
        self.marks_at, self.at = marks_offset(head_len), frames_offset(head_len, layers)
        self.frame, self.k_end = c.frame_size, FRAME_HEAD.size + c.part
        if self.at + layers * c.frame_size > loc.length:
            raise KVTransferError(f"nixl payload of {loc.request_id!r} is cut short")
        self.collector = c
        return 0

    def frame_end(self, layer: int) -> int:
        """The payload offset where layer ``layer``'s frame ends."""
        return self.at + (layer + 1) * self.frame

    def arrived(self, landed: int) -> None:
        """Bytes ``0..landed`` of the payload are in: check every layer they complete."""
        if self.collector is None and self.header(self.view, landed):
            return
        c, view = self.collector, self.view
        assert c is not None
        while self.next < c.header.layout.num_layers:
            i = self.next
            start = self.at + i * self.frame
            if start + self.frame > landed:
                return
            if self.marks:
                at = self.marks_at + i * MARK_BYTES
                if view[at : at + MARK_BYTES] != layer_mark(self.loc.capability, i):
                    raise KVTransferError(
                        f"KV layer {i} of {self.loc.request_id!r} was never written"
                    )
            if self.in_place:
                # The header-and-K and V pieces with their CRCs: the collector keeps them as
                # they lie and checks the frame's CRC, combined from these, against its header.
                k_end, end = start + self.k_end, start + self.frame
                for piece in (view[start:k_end], view[k_end:end]):
                    c.feed(piece, fast_crc32(piece))
            else:
                c.feed(view[start : start + self.frame])  # checked and copied out
            self.next += 1

    def build(self) -> KVPayload:
        if self.collector is None:
            raise KVTransferError(f"nixl payload of {self.loc.request_id!r} has no header")
        return self.collector.build()
