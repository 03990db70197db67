"""Sharing one host's compute between the engines of several worker processes."""

from pdserve.compute.lease import CoreSplit, HostLease, LeaseStats

__all__ = ["CoreSplit", "HostLease", "LeaseStats"]
