"""Cluster-level scheduling: worker heartbeats, placement policies and reservations in Redis.

Pure Python on redis.asyncio: this package imports neither torch nor grpc. Import from the
modules themselves: the package re-exports nothing, so a worker that needs only `keys` does
not load the scheduler.
"""
