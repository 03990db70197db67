"""Sharing one host's compute between the engines of several worker processes."""

from pdserve.compute.lease import HostLease, LeaseStats

__all__ = ["HostLease", "LeaseStats"]
