"""``SendFaults``: the faults a sender injects on purpose (fault tests only; never set in
production). ``stream``, ``shm`` and ``fake`` honour corrupt and stall; drop is the fake's
alone (the KV store and a decode worker's inbox refuse a stream shorter than it announced,
before any reader).

Each applies to the requests whose id starts with its prefix (None: the fault is off;
"": every request).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SendFaults:
    """What a sender does wrong, and to which requests."""

    corrupt_prefix: str | None = None
    """Flip one byte of the first layer after its checksum was taken (the receiver must
    notice)."""
    stall_prefix: str | None = None
    """Stop sending after ``stall_after_layers`` layers, without ending the hand-off: the
    commit runs into its timeout, a receiver into its own."""
    stall_after_layers: int = 1
    drop_prefix: str | None = None
    """Lose the layers ``drop_layers`` on the way (after the sender counted them): the commit
    succeeds, the receiver must notice that they never arrived (``fake``)."""
    drop_layers: frozenset[int] = frozenset()

    def corrupts(self, request_id: str) -> bool:
        return self.corrupt_prefix is not None and request_id.startswith(self.corrupt_prefix)

    def stalls(self, request_id: str) -> bool:
        return self.stall_prefix is not None and request_id.startswith(self.stall_prefix)

    def withholds(self, request_id: str, layer: int, layers_taken: int) -> bool:
        """The sender keeps ``layer`` back: dropped, or stalled after ``layers_taken`` (this
        one counted) passed ``stall_after_layers``."""
        if self.drops(request_id, layer):
            return True
        return self.stalls(request_id) and layers_taken > self.stall_after_layers

    def drops(self, request_id: str, layer: int) -> bool:
        return (
            self.drop_prefix is not None
            and request_id.startswith(self.drop_prefix)
            and layer in self.drop_layers
        )
