"""The sim flags' defaults and the flags they become, in one place for every command
that starts sim workers (``pdserve up``, ``bench serve``, ``sim plan``, the footprint and
control-plane benchmarks). Imports nothing, so a command's ``--help`` stays fast."""

from __future__ import annotations

DEFAULT_PROFILE = "roofline:h100:llama-3-8b"
"""``--sim-profile`` where a command offers one by default: H100s serving Llama-3-8B."""
DEFAULT_LINK = "rdma-400"
"""``--sim-link``: a 400 Gb/s RDMA NIC, what disaggregated clusters hand KV over."""


def sim_flags(profile: str, time_scale: float = 1.0, link: str = DEFAULT_LINK) -> list[str]:
    """The flags naming this profile, scale and link: the same on a worker, `pdserve up`
    and `bench serve`."""
    return [f"--sim-profile={profile}", f"--sim-time-scale={time_scale}", f"--sim-link={link}"]
