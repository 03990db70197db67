"""ComputeGate: the seam through which an engine shares its device with other processes.

The engine brackets the compute of each step with ``hold(prefill_tokens, decodes)``, calls
``checkpoint()`` between layers of a step that computes prompt tokens (a place where a long
step can lend the device to a short one of another engine; ``pdserve.compute.HostLease`` on
a CPU host) and ``idle()`` when a step leaves it with no work. ``UNGATED`` does none of it:
an engine alone on its device.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol


class ComputeGate(Protocol):
    def hold(self, prefill_tokens: int, decodes: int = 0) -> AbstractContextManager[None]:
        """Hold the device for one step that computes ``prefill_tokens`` prompt tokens and
        the next token of ``decodes`` running streams."""
        ...

    def checkpoint(self) -> None:
        """Between layers: give the device away for a while if another engine needs it."""
        ...

    def idle(self) -> None:
        """The engine has no work left."""
        ...


class Ungated:
    """No sharing: the engine has its device to itself."""

    def hold(self, prefill_tokens: int, decodes: int = 0) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def checkpoint(self) -> None:
        return None

    def idle(self) -> None:
        return None


UNGATED = Ungated()
