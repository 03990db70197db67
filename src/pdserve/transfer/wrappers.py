"""Sender wrappers: the same hand-off (any ``KVSender``), changed on its way out.

* ``Deferred``: the layer-wise overlap switched off (the layers are kept until ``commit`` and
  only then sent), the baseline of the transfer benchmark (``--no-layerwise``).
* ``Suffix``: only the prompt's tokens after a prefix the decode worker already holds
  (``decode_prefix``).
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.engine.kv_payload import KVLayout
from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    KVSender,
    TransferState,
    TransportKind,
)


class Deferred:
    """A ``KVSender`` whose layers leave only at ``commit`` (no overlap with the compute)."""

    def __init__(self, inner: KVSender) -> None:
        self.inner = inner
        self._layers: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    @property
    def kind(self) -> TransportKind:
        return self.inner.kind

    @property
    def state(self) -> TransferState:
        return self.inner.state

    @property
    def record(self) -> HandoffRecord:
        return self.inner.record

    @property
    def busy_ns(self) -> int:
        return self.inner.busy_ns

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        self.inner.begin(request_id, layout, num_tokens)

    def planned(self) -> KVLocation:
        return self.inner.planned()

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # Keeping them is the engine's export, done layer by layer (the views die after this).
        self._layers.append((layer, k.detach().clone(), v.detach().clone()))

    async def commit(self, timeout_s: float) -> KVLocation:
        layers, self._layers = self._layers, []
        for layer, k, v in layers:
            self.inner.send_layer(layer, k, v)
        return await self.inner.commit(timeout_s)

    async def discard(self) -> None:
        self._layers = []
        await self.inner.discard()


class Suffix:
    """A ``KVSender`` moving only the prompt's tokens after its first ``prefix_tokens``: the
    decode worker's prefix cache holds those (``decode_prefix``). Each hooked layer is cut to
    ``[prefix_tokens:]`` (a view; the inner transport makes its one copy from it)."""

    def __init__(self, inner: KVSender, prefix_tokens: int) -> None:
        if prefix_tokens < 1:
            raise InvalidArgumentError("prefix_tokens", f"must be >= 1, got {prefix_tokens}")
        self.inner = inner
        self.prefix_tokens = prefix_tokens

    @property
    def kind(self) -> TransportKind:
        return self.inner.kind

    @property
    def state(self) -> TransferState:
        return self.inner.state

    @property
    def record(self) -> HandoffRecord:
        return self.inner.record

    @property
    def busy_ns(self) -> int:
        return self.inner.busy_ns

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        if num_tokens <= self.prefix_tokens:
            raise InvalidArgumentError(
                "prefix_tokens", f"{self.prefix_tokens} leaves nothing of {num_tokens} tokens"
            )
        self.inner.begin(request_id, layout, num_tokens - self.prefix_tokens)

    def planned(self) -> KVLocation:
        return self.inner.planned()

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.send_layer(layer, k[self.prefix_tokens :], v[self.prefix_tokens :])

    async def commit(self, timeout_s: float) -> KVLocation:
        # The decode worker joins its cached prefix to the payload (``prefix_tokens``).
        location = await self.inner.commit(timeout_s)
        return dataclasses.replace(location, prefix_tokens=self.prefix_tokens)

    async def discard(self) -> None:
        await self.inner.discard()
