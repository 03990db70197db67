"""Mooncake Store as the KV store (``--kvstore mooncake://MASTER``): ``MooncakeStoreClient``
behind the same seam as ``KVStoreClient`` (``kvstore.backend``), and ``MasterProcess``, a
``mooncake_master`` child. The Mooncake package is optional (``pdserve[mooncake]``) and loaded
only when a ``mooncake://`` address is used."""

from __future__ import annotations

from pdserve.kvstore.mooncake.address import MooncakeAddress, is_mooncake
from pdserve.kvstore.mooncake.client import MooncakeStoreClient
from pdserve.kvstore.mooncake.library import EXTRA, available, load
from pdserve.kvstore.mooncake.master import MasterProcess

__all__ = [
    "EXTRA",
    "MasterProcess",
    "MooncakeAddress",
    "MooncakeStoreClient",
    "available",
    "is_mooncake",
    "load",
]
