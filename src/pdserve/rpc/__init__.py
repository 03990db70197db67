"""gRPC plumbing shared by the services: server construction, error mapping, message sizes.

The floor of everything that speaks gRPC: it names no domain type (converting messages is
``pdserve.convert``'s, a package's own ``convert`` module's, or ``pdserve.adapters``'), so
every layer may build on it (a contract in ``pyproject.toml``)."""
