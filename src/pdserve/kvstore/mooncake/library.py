"""The Mooncake package, loaded on demand: ``pip install 'pdserve[mooncake]'`` provides it.

Nothing imports ``mooncake`` at module level, so pdserve runs without it; a ``mooncake://``
KV store address is refused at start (``load``) naming the extra, never silently replaced
by another store. A decode worker handed a Mooncake hand-off it cannot read recomputes instead
(``MooncakeUnavailableError`` tells that refusal apart from a malformed address).
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.errors import InvalidArgumentError

EXTRA = "pdserve[mooncake]"
PACKAGE = "mooncake-transfer-engine-non-cuda"


class MooncakeUnavailableError(InvalidArgumentError):
    """The Mooncake package cannot load in this process (a refusal naming the field and the
    extra at start; on a decode worker's hand-off, a reason to recompute)."""


@dataclass(frozen=True, slots=True)
class Library:
    """The loaded ``mooncake.store`` module."""

    module: Any

    def store_class(self) -> Any:
        """A new, unjoined ``MooncakeDistributedStore``."""
        return self.module.MooncakeDistributedStore()

    def replicate_config(self, replicas: int) -> Any:
        config = self.module.ReplicateConfig()
        config.replica_num = replicas
        return config

    def put_parts(self, store: Any, key: str, parts: Sequence[np.ndarray], config: Any) -> int:
        """Put one object made of ``parts`` (contiguous uint8 arrays, in order) without joining
        them first: the library gathers them itself (``batch_put_from_multi_buffers``); a
        library without that call gets one joined buffer. Its return code (0: stored)."""
        if hasattr(store, "batch_put_from_multi_buffers"):
            ptrs = [[part.ctypes.data for part in parts]]
            sizes = [[part.nbytes for part in parts]]
            return int(store.batch_put_from_multi_buffers([key], ptrs, sizes, config)[0])
        joined = np.concatenate(parts)
        return int(store.put_from(key, joined.ctypes.data, joined.nbytes, config))

    def master_binary(self) -> str:
        """The ``mooncake_master`` executable the package ships (or one on ``PATH``)."""
        package_dir = os.path.dirname(os.path.dirname(self.module.__file__))
        shipped = os.path.join(package_dir, "mooncake", "mooncake_master")
        if os.access(shipped, os.X_OK):
            return shipped
        found = shutil.which("mooncake_master")
        if found is None:
            raise InvalidArgumentError(
                "kv_store", f"mooncake_master is not installed (install {EXTRA})"
            )
        return found


def load(field: str = "kvstore") -> Library:
    """The Mooncake library; refuses (naming ``field`` and the extra) if it cannot load."""
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as err:
        raise MooncakeUnavailableError(
            field,
            f"a mooncake:// KV store needs the Mooncake package: pip install '{EXTRA}' "
            f"(it provides {PACKAGE}; on Linux it also needs libibverbs1, librdmacm1 and "
            f"libnuma1): {err}",
        ) from err
    return Library(module)


def available() -> str:
    """Empty if the library loads here, else why not (for tests that skip with a reason)."""
    try:
        load()
    except InvalidArgumentError as err:
        return str(err)
    return ""
