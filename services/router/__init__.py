"""The Router gRPC service: the public entry point of a pdserve cluster."""
