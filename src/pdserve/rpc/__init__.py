"""gRPC plumbing shared by the services: server construction and error mapping."""
