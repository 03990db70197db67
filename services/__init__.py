"""The gRPC services; each is started with `python -m services.<name>`."""
