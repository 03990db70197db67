"""The modelled links a sim worker's KV hand-offs cross, as ``transfer.links.Link``s.

Each is the datasheet line rate times the fraction a bulk transfer sustains, in bytes/s, and
a per-transfer latency (set-up, first byte).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.links import Link

LINKS: Mapping[str, Link] = MappingProxyType(
    {
        # NVLink 4 (H100 SXM): 900 GB/s bidirectional, 450 GB/s each way; a few microseconds
        # to set up a peer copy.
        "nvlink": Link(450e9, 5e-6),
        # 400 Gb/s InfiniBand/RoCE NIC (ConnectX-7): 50 GB/s line rate, about 90% of it for
        # large RDMA writes after headers; ~10 us to post and complete a work request across a
        # switch.
        "rdma-400": Link(400e9 / 8 * 0.9, 10e-6),
        # 200 Gb/s (HDR / ConnectX-6): the same reasoning at half the rate.
        "rdma-200": Link(200e9 / 8 * 0.9, 10e-6),
        # 25 Gb/s Ethernet over TCP: about 80% of line rate after TCP/IP overhead and copies;
        # ~50 us through the kernel network stacks at both ends.
        "tcp-25": Link(25e9 / 8 * 0.8, 50e-6),
        # Both workers on one host: a copy through host memory (device -> pinned host ->
        # device over PCIe Gen4/5, or a memcpy between processes), about 20 GB/s sustained.
        "same-host": Link(20e9, 20e-6),
    }
)

LINK_NAMES: tuple[str, ...] = tuple(LINKS)


def parse_link(name: str, flag: str = "--sim-link") -> Link:
    """A link by name (``LINK_NAMES``); unknown names are refused naming ``flag``."""
    key = name.strip().lower()
    if key in LINKS:
        return LINKS[key]
    choices = ", ".join(LINK_NAMES)
    raise InvalidArgumentError(flag, f"unknown link {name!r}; choose one of {choices}")
