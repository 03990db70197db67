"""How long a KV hand-off takes over a modelled link between a prefill and a decode worker.

A transfer costs a fixed latency plus its bytes over the link's achievable bandwidth (the
datasheet line rate times the fraction a bulk transfer sustains). Bandwidths are bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class LinkModel:
    """A point-to-point link: ``bandwidth`` in bytes/s (achievable, not line rate) and a
    per-transfer ``latency_s`` (set-up, first byte)."""

    name: str
    bandwidth: float
    latency_s: float

    def transfer_time(self, num_bytes: int) -> float:
        """Seconds to move ``num_bytes``: latency + bytes / bandwidth; nothing to move, 0."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, not {num_bytes}")
        if num_bytes == 0:
            return 0.0
        return self.latency_s + num_bytes / self.bandwidth


LINKS: dict[str, LinkModel] = {
    # NVLink 4 (H100 SXM): 900 GB/s bidirectional, 450 GB/s each way; a few microseconds
    # to set up a peer copy.
    "nvlink": LinkModel("nvlink", 450e9, 5e-6),
    # 400 Gb/s InfiniBand/RoCE NIC (ConnectX-7): 50 GB/s line rate, about 90% of it for large
    # RDMA writes after headers; ~10 us to post and complete a work request across a switch.
    "rdma-400": LinkModel("rdma-400", 400e9 / 8 * 0.9, 10e-6),
    # 200 Gb/s (HDR / ConnectX-6): the same reasoning at half the rate.
    "rdma-200": LinkModel("rdma-200", 200e9 / 8 * 0.9, 10e-6),
    # 25 Gb/s Ethernet over TCP: about 80% of line rate after TCP/IP overhead and copies;
    # ~50 us through the kernel network stacks at both ends.
    "tcp-25": LinkModel("tcp-25", 25e9 / 8 * 0.8, 50e-6),
    # Both workers on one host: a copy through host memory (device -> pinned host -> device
    # over PCIe Gen4/5, or a memcpy between processes), about 20 GB/s sustained.
    "same-host": LinkModel("same-host", 20e9, 20e-6),
}

LINK_NAMES: tuple[str, ...] = tuple(LINKS)


def parse_link(name: str, flag: str = "--sim-link") -> LinkModel:
    """A link by name (``LINK_NAMES``); unknown names are refused naming ``flag``."""
    key = name.strip().lower()
    if key in LINKS:
        return LINKS[key]
    choices = ", ".join(LINK_NAMES)
    raise InvalidArgumentError(flag, f"unknown link {name!r}; choose one of {choices}")
