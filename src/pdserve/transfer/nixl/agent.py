"""The NIXL library, loaded on demand, and what a prefill worker publishes of its agent.

``nixl_api()`` imports the NIXL Python API (the ``nixl`` module of the ``pdserve[nixl]`` extra,
or ``nixl_cu12``, the module its wheel installs); without it, ``NixlUnavailableError`` names
the extra. ``AgentDescriptor`` is what a prefill worker's heartbeat carries (``kv_agent``):
its agent's name and metadata and where its block pool lies, and ``fingerprint`` (BLAKE2b
over all of it) is what every hand-off's handle names, so that a reader loads exactly the
metadata the writer published.

Torch-free: the scheduler and the heartbeat code import it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pdserve.errors import InvalidArgumentError, KVTransferError

EXTRA = "pdserve[nixl]"
"""The optional extra that installs NIXL."""

_MODULES = ("nixl", "nixl_cu12")
TAG_BYTES = 16
"""Bytes of a block's tag: the capability of the hand-off holding it (zeros: free)."""


class NixlUnavailableError(InvalidArgumentError):
    """NIXL cannot be imported here (the extra is not installed)."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(
            field, f"the nixl transport needs the {EXTRA} extra (pip install '{EXTRA}'): {detail}"
        )


def _skip_absent_rdma() -> None:
    """UCX loads its InfiniBand module, and with it the wheel's libnl, even on a host without
    an RDMA device; that libnl's destructor then crashes the process at exit (SIGSEGV in
    ``rtnl_tc_unregister``, after everything else ran: exit status 139, measured with
    nixl-cu12 1.5.1). Where no RDMA device exists and nobody chose UCX's modules, UCX is told
    to leave that module out. It must be in the environment before UCX starts (the first
    agent), and children inherit it."""
    if "UCX_MODULES" in os.environ:
        return
    devices = Path("/sys/class/infiniband")
    if devices.is_dir() and any(devices.iterdir()):
        return
    os.environ["UCX_MODULES"] = "^ib"


def nixl_api(field: str = "--transport") -> ModuleType:
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``); ``field``: what an
    error names."""
    _skip_absent_rdma()
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            errors.append(f"{name}: {err}")
            continue
        if hasattr(module, "nixl_agent"):
            return module
        errors.append(f"{name}: has no nixl_agent")
    raise NixlUnavailableError(field, "; ".join(errors))


PROGRESS_DELAY_US = 100
"""How long an agent's progress thread waits between polls when it finds nothing to do. NIXL's
Python wrapper (nixl-cu12 1.5.1) always sets 0, which makes the UCX backend's progress thread
poll without pause: one core per agent, for the process's life, taken from the engines on a
host whose cores they share. The wait bounds how late a peer's request is served only when no
event woke the thread first."""

_MAKING = threading.Lock()
"""Held while an agent is made with ``PROGRESS_DELAY_US`` (see ``make_agent``)."""


def make_agent(api: ModuleType, name: str) -> Any:
    """A NIXL agent named ``name`` with the UCX backend and a progress thread that waits
    ``PROGRESS_DELAY_US`` between idle polls.

    The wrapper builds its own ``nixlAgentConfig`` and sets its delay to 0; while this agent is
    made, the bindings' config class is one that never takes a delay below ours. A NIXL whose
    bindings differ gets the wrapper's own agent (it may poll without pause)."""
    config = api.nixl_agent_config(backends=["UCX"])
    try:
        bindings: Any = importlib.import_module(f"{api.__name__}._bindings")
    except ImportError:
        return api.nixl_agent(name, config)
    config_class = getattr(bindings, "nixlAgentConfig", None)
    delay: Any = getattr(config_class, "__dict__", {}).get("pthrDelay")
    if config_class is None or delay is None:
        return api.nixl_agent(name, config)

    class _Waiting(config_class):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (the bindings' name)
            return int(delay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            delay.__set__(self, max(int(value), PROGRESS_DELAY_US))

    with _MAKING:
        bindings.nixlAgentConfig = _Waiting
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = config_class


def nixl_available() -> bool:
    try:
        nixl_api()
    except NixlUnavailableError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class AgentDescriptor:
    """A prefill worker's NIXL agent and its registered block pool, as its heartbeat
    publishes them. The pool is one registered region: ``num_blocks`` tags of ``TAG_BYTES``
    at ``tags_addr``, then ``num_blocks`` blocks of ``block_bytes`` at ``data_addr``."""

    agent: str
    metadata: bytes
    tags_addr: int
    data_addr: int
    num_blocks: int
    block_bytes: int

    def __post_init__(self) -> None:
        if not self.agent:
            raise InvalidArgumentError("kv_agent.agent", "must not be empty")
        for name in ("tags_addr", "data_addr", "num_blocks", "block_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"kv_agent.{name}", f"must be an int >= 0: {value!r}")
        if self.num_blocks < 1 or self.block_bytes < 1:
            raise InvalidArgumentError("kv_agent.num_blocks", "the pool must hold blocks")

    def encode(self) -> str:
        """Canonical JSON (what the heartbeat carries and the fingerprint covers)."""
        return json.dumps(
            {
                "agent": self.agent,
                "metadata": base64.b64encode(self.metadata).decode(),
                "tags_addr": self.tags_addr,
                "data_addr": self.data_addr,
                "num_blocks": self.num_blocks,
                "block_bytes": self.block_bytes,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.encode())

    @classmethod
    def decode(cls, text: str) -> AgentDescriptor:
        try:
            raw: Any = json.loads(text)
            return cls(
                agent=str(raw["agent"]),
                metadata=base64.b64decode(raw["metadata"], validate=True),
                tags_addr=raw["tags_addr"],
                data_addr=raw["data_addr"],
                num_blocks=raw["num_blocks"],
                block_bytes=raw["block_bytes"],
            )
        except (ValueError, KeyError, TypeError) as err:
            raise KVTransferError(f"published NIXL agent descriptor unreadable: {err}") from err

    def block_range(self, block: int) -> tuple[int, int]:
        """``(address, length)`` of one block; ``KVTransferError`` outside the pool."""
        if not 0 <= block < self.num_blocks:
            raise KVTransferError(
                f"block {block} lies outside {self.agent}'s registered pool of "
                f"{self.num_blocks} blocks"
            )
        return self.data_addr + block * self.block_bytes, self.block_bytes


def fingerprint(encoded: str) -> str:
    """BLAKE2b-128 (hex) of a descriptor's canonical JSON."""
    return hashlib.blake2b(encoded.encode(), digest_size=16).hexdigest()
